// The GGUF product's integer sums on AMX tiles (Sapphire Rapids and later), for 2-32 activation rows.
// Included by qmatmul.cpp inside its namespace, after the AVX-512 VNNI tiles, whose terms and
// arithmetic it shares (qmatmul.cpp's header).
//
// Terms:
//   tile       one of AMX's 8 matrix registers, up to 16 rows of 64 bytes, shaped by a tile
//              configuration loaded per thread (ldtilecfg)
//   tdpbsud    C[m][n] += sum_k A[m][k] * B[k/4][4n + k%4] over the 64 or fewer bytes of A's rows:
//              A signed bytes (activation codes, one row per activation row), B unsigned bytes
//              (weight codes: 4 inputs x 16 output rows per B row, the kernel's step layout), C int32
//
// A sub-block's codes make one B tile (S/4 rows: 4-bit codes unpacked into bytes, 6-bit ones
// joined, 8-bit ones loaded as they are), the activation rows' codes of the same S inputs one A
// tile per 16 rows, and one tdpbsud gives every row's dot_s for the group's 16 outputs: the same
// int32 as the VNNI tile's, since integer sums do not depend on their order. From those sums on,
// each output is computed with the VNNI tile's float operations in the VNNI tile's order, so the
// two give the same bits (tests/kernels/test_qmatmul_kernels.py).
//
// Linux hands out the tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM);
// set_kernel("amx") asks once. The configuration is loaded at every group: other code on the thread
// (oneDNN's AMX matmuls) loads its own.

constexpr int AMX_ROWS = 32;       // activation rows per group call: two passes of at most 16
constexpr int AMX_TILE_ROWS = 16;
constexpr int AMX_MAX_SUBS = 16;   // sub-blocks whose sums are kept at once (a k-quant super-block's, at most)
constexpr int AMX_EPILOGUE_ROWS = 8;  // rows whose float sums an epilogue pass keeps in registers

bool amx_enabled = false;          // set_kernel("amx"): products of at least AMX_MIN_ROWS rows use the tiles
constexpr int64_t AMX_MIN_ROWS = 2;  // one row (a decode step) stays on the VNNI kernel

// Ask Linux for the tile state (once per process); false where it refuses.
bool amx_request() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A pass multiplies up to 16 rows (one A tile) by a group's codes, two sub-blocks at a time: tiles
// 0, 2 and 3 hold sub-block j's activation codes (rows x S bytes), codes (S/4 rows of 64 bytes)
// and int32 sums (rows x 16 outputs), tiles 1, 5 and 4 sub-block j + 1's, so that one tdpbsud
// runs while the other's tiles load or store (a tile register is not renamed: reusing one waits
// for the instruction before). More than 16 rows take two passes of ceil(T / 2) rows, the second
// ending at the last row (an odd T computes its middle row twice, the same bits both times).
inline int amx_pass_rows(int T) { return T <= AMX_TILE_ROWS ? T : (T + 1) / 2; }

inline void configure_tiles(int pass_rows, int S) {
  TileConfig cfg;
  for (int tile : {0, 1}) cfg.rows[tile] = pass_rows, cfg.colsb[tile] = S;
  for (int tile : {2, 5}) cfg.rows[tile] = S / 4, cfg.colsb[tile] = 64;
  for (int tile : {3, 4}) cfg.rows[tile] = pass_rows, cfg.colsb[tile] = 64;
  _tile_loadconfig(&cfg);
}

// A sub-block's codes (its steps) as a B tile's rows: 4 inputs x 16 outputs, one byte each
template <int BITS, int S>
inline const uint8_t* codes_as_bytes(const uint8_t* codes, uint8_t* buf) {
  if constexpr (BITS == 8) return codes;  // already one byte per code, 4 inputs per 64 bytes
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  constexpr int64_t steps = S / step_k<BITS>();
  for (int64_t c = 0; c < steps; ++c) {
    const uint8_t* chunk = codes + c * step_bytes<BITS>();
    const __m512i raw = _mm512_loadu_si512(chunk);
    uint8_t* rows = buf + c * step_k<BITS>() / 4 * 64;
    if constexpr (BITS == 4) {
      _mm512_store_si512(rows, _mm512_and_si512(raw, low4));
      _mm512_store_si512(rows + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
    } else {
      const __m512i raw2 = _mm512_loadu_si512(chunk + 64), top = _mm512_loadu_si512(chunk + 128);
      _mm512_store_si512(rows, _mm512_or_si512(_mm512_and_si512(raw, low4), _mm512_and_si512(_mm512_slli_epi16(top, 4), bits45)));
      _mm512_store_si512(rows + 64, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4),
                                                    _mm512_and_si512(_mm512_slli_epi16(top, 2), bits45)));
      _mm512_store_si512(rows + 128, _mm512_or_si512(_mm512_and_si512(raw2, low4), _mm512_and_si512(top, bits45)));
      _mm512_store_si512(rows + 192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw2, 4), low4),
                                                     _mm512_and_si512(_mm512_srli_epi16(top, 2), bits45)));
    }
  }
  return buf;
}

// One pass: rows r .. r + pass_rows - 1, sub-blocks s0 .. s0 + n - 1 (code_bytes[j]: their B tiles' rows)
// into sums[j][r - r0]
template <int S>
inline void pass_sums(const uint8_t* const* code_bytes, int64_t s0, int64_t n, const Acts& a, int64_t K, int64_t r,
                      int64_t t0, int32_t (*sums)[AMX_ROWS][LANES]) {
  const int8_t* x = a.xq + r * K + s0 * S;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    _tile_loadd(2, code_bytes[j], 64);
    _tile_loadd(0, x + j * S, K);
    _tile_zero(3);
    _tile_loadd(5, code_bytes[j + 1], 64);
    _tile_loadd(1, x + (j + 1) * S, K);
    _tile_zero(4);
    _tile_dpbsud(3, 0, 2);
    _tile_dpbsud(4, 1, 5);
    _tile_stored(3, &sums[j][t0][0], 64);
    _tile_stored(4, &sums[j + 1][t0][0], 64);
  }
  if (j < n) {
    _tile_loadd(2, code_bytes[j], 64);
    _tile_loadd(0, x + j * S, K);
    _tile_zero(3);
    _tile_dpbsud(3, 0, 2);
    _tile_stored(3, &sums[j][t0][0], 64);
  }
}

// Per-thread buffers: the codes of two runs of up to AMX_MAX_SUBS sub-blocks as bytes (one being
// multiplied while the next is unpacked), and the int32 sums of a run for AMX_ROWS rows
struct AmxScratch {
  alignas(64) uint8_t codes[2][AMX_MAX_SUBS][32 / 4 * 64];
  alignas(64) int32_t sums[AMX_MAX_SUBS][AMX_ROWS][LANES];
};
inline AmxScratch* amx_scratch() {
  thread_local AmxScratch scratch;
  return &scratch;
}

// A run: sub-blocks s0 .. s0 + n - 1 of a group's codes, their B tiles' rows in buf[j] (code_bytes[j]
// points at them: 8-bit codes are used in place)
struct SubBlockRun {
  int64_t s0 = 0, n = 0;
  const uint8_t* code_bytes[AMX_MAX_SUBS];
};

template <int BITS, int S>
inline SubBlockRun unpack_run(const uint8_t* codes, int64_t s0, int64_t n, uint8_t (*buf)[32 / 4 * 64]) {
  constexpr int64_t sub_bytes = S / step_k<BITS>() * step_bytes<BITS>();
  SubBlockRun run;
  run.s0 = s0, run.n = n;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* sub_codes = codes + (s0 + j) * sub_bytes;
    for (int64_t b = 0; b < sub_bytes; b += 64) _mm_prefetch((const char*)sub_codes + PREFETCH_BYTES + b, _MM_HINT_T0);
    run.code_bytes[j] = codes_as_bytes<BITS, S>(sub_codes, buf[j]);
  }
  return run;
}

// The run's sums for rows r0 .. r0 + T - 1 into sums[j] (one or two passes)
template <int S>
inline void run_sums(const SubBlockRun& run, const Acts& a, int64_t K, int64_t r0, int T,
                     int32_t (*sums)[AMX_ROWS][LANES]) {
  const int pass_rows = amx_pass_rows(T);
  pass_sums<S>(run.code_bytes, run.s0, run.n, a, K, r0, 0, sums);
  if (pass_rows < T) pass_sums<S>(run.code_bytes, run.s0, run.n, a, K, r0 + T - pass_rows, T - pass_rows, sums);
}

// k-quants, C rows from t0: a super-block's outputs from its sub-blocks' sums, with the VNNI tile's
// float operations in its order (group_tile_k)
template <int C>
void k_epilogue(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, int t0, int64_t sb,
                const __m512* scales, int32_t (*sums)[AMX_ROWS][LANES], float* y, int64_t ldy, int64_t col0) {
  const int64_t subs_per_sb = L.SB / L.S;
  const int16_t* xs[C];
  for (int t = 0; t < C; ++t) xs[t] = sub_sums(a, L, r0 + t0 + t);
  __m512 fsum[C];
  k_correction<C>(L, w, g, sb, xs, fsum);
  for (int64_t j = 0; j < subs_per_sb; ++j)
    for (int t = 0; t < C; ++t)
      fsum[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[j][t0 + t])), scales[j], fsum[t]);
  for (int t = 0; t < C; ++t) {
    float* out = y + (r0 + t0 + t) * ldy + col0 + g * LANES;
    _mm512_storeu_ps(out, _mm512_fmadd_ps(fsum[t], _mm512_set1_ps(act_scales(a, L, r0 + t0 + t)[sb]), _mm512_loadu_ps(out)));
  }
}

// legacy types, C rows from t0: sub-blocks s0 .. s0 + n - 1 added to the rows' float sums in y, with
// the VNNI tile's float operations in its order (group_tile_legacy)
template <int C>
void legacy_epilogue(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, int t0, int64_t s0,
                     int64_t n, int32_t (*sums)[AMX_ROWS][LANES], float* y, int64_t ldy, int64_t col0) {
  const int64_t nsub = L.K / L.S;
  const int shift = act_shift(a);
  float* out[C];
  __m512 acc[C];
  for (int t = 0; t < C; ++t) out[t] = y + (r0 + t0 + t) * ldy + col0 + g * LANES, acc[t] = _mm512_loadu_ps(out[t]);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = s0 + j;
    const __m512 scale = load_half16(w.d + (g * nsub + s) * LANES);
    __m512 offset = _mm512_mul_ps(scale, _mm512_set1_ps(-(float)L.z));
    if (L.has_dmin) offset = _mm512_add_ps(offset, load_half16(w.dmin + (g * nsub + s) * LANES));
    for (int t = 0; t < C; ++t) {
      const float dx = act_scales(a, L, r0 + t0 + t)[(s * 32) >> shift];
      const __m512i iacc = _mm512_load_si512(sums[j][t0 + t]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_mul_ps(scale, _mm512_set1_ps(dx)), acc[t]);
      acc[t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(dx * (float)sub_sums(a, L, r0 + t0 + t)[s]), acc[t]);
    }
  }
  for (int t = 0; t < C; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

// an epilogue over T rows, AMX_EPILOGUE_ROWS at a time (F: a lambda taking the template's C)
template <typename F>
inline void by_row_chunks(int T, F&& f) {
  int t0 = 0;
  for (; t0 + AMX_EPILOGUE_ROWS <= T; t0 += AMX_EPILOGUE_ROWS) f(std::integral_constant<int, AMX_EPILOGUE_ROWS>{}, t0);
  if (t0 < T) {
    const int rest = T - t0;
    switch (rest) {
      case 1: f(std::integral_constant<int, 1>{}, t0); break;
      case 2: f(std::integral_constant<int, 2>{}, t0); break;
      case 3: f(std::integral_constant<int, 3>{}, t0); break;
      case 4: f(std::integral_constant<int, 4>{}, t0); break;
      case 5: f(std::integral_constant<int, 5>{}, t0); break;
      case 6: f(std::integral_constant<int, 6>{}, t0); break;
      default: f(std::integral_constant<int, 7>{}, t0); break;
    }
  }
}

// rows r0 .. r0 + T - 1 (T <= AMX_ROWS) of group g's outputs, a k-quant: a super-block a run. The
// next super-block's codes are unpacked between the tiles' work on this one and its epilogue, so
// that no tile loads bytes just stored (a tile load waits for the stores it overlaps to retire)
template <int BITS, int S>
void amx_group_k(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, int T, float* y,
                 int64_t ldy, int64_t col0) {
  const int64_t nsub = L.K / S, subs_per_sb = L.SB / S, super_blocks = L.K / L.SB;
  const uint8_t* codes = w.codes + g * (L.K / step_k<BITS>()) * step_bytes<BITS>();
  AmxScratch* scratch = amx_scratch();
  configure_tiles(amx_pass_rows(T), S);
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (r0 + t) * ldy + col0 + g * LANES, _mm512_setzero_ps());
  __m512 scales[AMX_MAX_SUBS];
  SubBlockRun run = unpack_run<BITS, S>(codes, 0, subs_per_sb, scratch->codes[0]);
  for (int64_t sb = 0; sb < super_blocks; ++sb) {
    const int64_t s0 = sb * subs_per_sb;
    run_sums<S>(run, a, L.K, r0, T, scratch->sums);
    if (sb + 1 < super_blocks) run = unpack_run<BITS, S>(codes, s0 + subs_per_sb, subs_per_sb, scratch->codes[(sb + 1) % 2]);
    const __m512 d = load_half16(w.d + (g * super_blocks + sb) * LANES);
    for (int64_t j = 0; j < subs_per_sb; ++j)
      scales[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(load_int16x(w.sc + (g * nsub + s0 + j) * LANES, L.sc_signed)), d);
    by_row_chunks(T, [&](auto c, int t0) {
      k_epilogue<decltype(c)::value>(L, w, g, a, r0, t0, sb, scales, scratch->sums, y, ldy, col0);
    });
  }
}

// rows r0 .. r0 + T - 1 (T <= AMX_ROWS) of group g's outputs, a legacy type (S = 32): runs of
// AMX_MAX_SUBS sub-blocks, unpacked one ahead as above
template <int BITS>
void amx_group_legacy(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, int T, float* y,
                      int64_t ldy, int64_t col0) {
  constexpr int S = 32;
  const int64_t nsub = L.K / S;
  const uint8_t* codes = w.codes + g * (L.K / step_k<BITS>()) * step_bytes<BITS>();
  AmxScratch* scratch = amx_scratch();
  configure_tiles(amx_pass_rows(T), S);
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (r0 + t) * ldy + col0 + g * LANES, _mm512_setzero_ps());
  SubBlockRun run = unpack_run<BITS, S>(codes, 0, std::min<int64_t>(AMX_MAX_SUBS, nsub), scratch->codes[0]);
  for (int64_t i = 0; run.n > 0; ++i) {
    const SubBlockRun current = run;
    run_sums<S>(current, a, L.K, r0, T, scratch->sums);
    const int64_t next = current.s0 + current.n;
    run = next < nsub ? unpack_run<BITS, S>(codes, next, std::min<int64_t>(AMX_MAX_SUBS, nsub - next), scratch->codes[(i + 1) % 2])
                      : SubBlockRun();
    by_row_chunks(T, [&](auto c, int t0) {
      legacy_epilogue<decltype(c)::value>(L, w, g, a, r0, t0, current.s0, current.n, scratch->sums, y, ldy, col0);
    });
  }
}

// Whether AMX multiplies this product (else the VNNI tiles do)
inline bool amx_takes(const Acts& a) { return amx_enabled && a.M >= AMX_MIN_ROWS; }

template <int BITS>
void amx_run_group(const Layout& L, const Weights& w, int64_t g, const Acts& a, float* y, int64_t ldy, int64_t col0) {
  for (int64_t r = 0; r < a.M; r += AMX_ROWS) {
    const int T = (int)std::min<int64_t>(AMX_ROWS, a.M - r);
    if constexpr (BITS == 8) amx_group_legacy<BITS>(L, w, g, a, r, T, y, ldy, col0);
    else if (!L.has_sc) amx_group_legacy<BITS>(L, w, g, a, r, T, y, ldy, col0);
    else if (L.S == 16) amx_group_k<BITS, 16>(L, w, g, a, r, T, y, ldy, col0);
    else amx_group_k<BITS, 32>(L, w, g, a, r, T, y, ldy, col0);
  }
}
