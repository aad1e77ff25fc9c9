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
// Q4_K and Q5_K fold their sub-block scales into the codes and sum a whole super-block in two
// tiles (below, "the sub-block scales folded"). The other types: a sub-block's codes make one B
// tile (S/4 rows: 4-bit codes unpacked into bytes, 6-bit ones joined, 8-bit ones loaded as they
// are), the activation rows' codes of the same S inputs one A tile per 16 rows, and one tdpbsud
// gives every row's dot_s for the group's 16 outputs: the same int32 as the VNNI tile's, since
// integer sums do not depend on their order. From those sums on, each output is computed with the
// VNNI tile's float operations in the VNNI tile's order, so the two give the same bits
// (tests/models/test_kernel_kinds.py).
//
// Linux hands out the tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM);
// set_kernel("amx" or "auto") asks once. The configuration is loaded at every group: other code on
// the thread (oneDNN's AMX matmuls) loads its own.

constexpr int AMX_ROWS = 32;       // activation rows per group call: two passes of at most 16
constexpr int AMX_TILE_ROWS = 16;
constexpr int AMX_MAX_SUBS = 16;   // sub-blocks whose sums are kept at once (a k-quant super-block's, at most)
constexpr int AMX_EPILOGUE_ROWS = 8;  // rows whose float sums an epilogue pass keeps in registers

// Which products the tiles multiply (set_kernel): none ("avx512_vnni"); Q4_K and Q5_K products of at
// least AMX_AUTO_ROWS rows ("auto", the default where Linux grants the tiles: the only ones
// measured faster than the VNNI kernel, docs/runner.md "AMX tiles"): a prefill, a batch's
// verify; or every product of at least AMX_MIN_ROWS rows ("amx", held for measuring).
// All give the same bits, so the choice never changes an output.
enum class AmxUse { never, wide, always };
AmxUse amx_use = AmxUse::never;
constexpr int64_t AMX_MIN_ROWS = 2;       // one row (a decode step) stays on the VNNI kernel
// from here the tiles were never slower on this project's Sapphire Rapids (2 threads, both kernels
// in one process: 0.95-1.5x at 32 rows, 1.5-1.8x at 64, 1.6-1.7x at 200; at 12-16 rows 0.63x in one
// hour and 1.25x in the next: docs/runner.md "AMX tiles")
constexpr int64_t AMX_AUTO_ROWS = 32;

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

// ldtilecfg reads all 64 bytes, which GCC does not know: the memory clobber keeps the stores of
// rows and colsb that it otherwise dropped as dead (the tiles then faulted as unconfigured)
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

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
  load_tile_config(cfg);
}

// A sub-block's codes (its steps) as a B tile's rows: 4 inputs x 16 outputs, one byte each
template <int BITS, int S>
inline const uint8_t* codes_as_bytes(const uint8_t* codes, uint8_t* buf) {
  if constexpr (BITS == 8) return codes;  // already one byte per code, 4 inputs per 64 bytes
  constexpr int64_t steps = S / step_k<BITS>(), rows_per_step = step_k<BITS>() / 4;
  for (int64_t c = 0; c < steps; ++c) {
    __m512i rows[4];
    step_rows<BITS>(codes + c * step_bytes<BITS>(), rows);
    for (int64_t r = 0; r < rows_per_step; ++r) _mm512_store_si512(buf + (c * rows_per_step + r) * 64, rows[r]);
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
template <int C, int S>
void k_epilogue(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, int t0, int64_t sb,
                const __m512* scales, int32_t (*sums)[AMX_ROWS][LANES], float* y, int64_t ldy, int64_t col0) {
  constexpr int64_t subs_per_sb = K_SUPER / S;
  const int16_t* xs[C];
  for (int t = 0; t < C; ++t) xs[t] = sub_sums(a, L, r0 + t0 + t);
  __m512 fsum[C];
  k_correction<C, S>(L, w, g, sb, xs, fsum);
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
      k_epilogue<decltype(c)::value, S>(L, w, g, a, r0, t0, sb, scales, scratch->sums, y, ldy, col0);
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

// ---- Q4_K and Q5_K: the sub-block scales folded into the codes ----------------------------------
//
// Their sub-block scales sc are 6-bit (0..63) and the VNNI kernel sums sc_s * dot_s over a
// super-block in integers, so a tile may do the same if each B byte holds code x scale. That
// exceeds a byte, so sc = hi << FOLD + lo is split, lo and hi both small enough that code x part
// fits one (Q4_K: codes <= 15, FOLD 4: lo <= 15, hi <= 3; Q5_K: codes <= 31, FOLD 3: lo, hi <= 7),
// and two sum tiles run a whole super-block: C_lo = sum_s lo_s dot_s, C_hi = sum_s hi_s dot_s, so
// the super-block's integer is C_hi << FOLD + C_lo, stored once (two tiles) where the unfolded
// tiles stored one per sub-block. A B row (4 inputs x 16 outputs) times its outputs' parts is one
// vpmullw: each int16 lane holds two codes of one output, and neither product carries into the
// other byte.

template <int BITS> constexpr int fold_shift() { return BITS == 4 ? 4 : 3; }
constexpr int64_t FOLD_WINDOWS = 4;  // a 256-input super-block in K windows of 64 (one tdpbsud each)

// 16 bytes (one per output) -> each output's value in both int16 lanes of its 4 bytes
inline __m512i per_output_pairs(__m512i values32) { return _mm512_or_si512(values32, _mm512_slli_epi32(values32, 16)); }

struct alignas(64) FoldedSuperBlock {
  uint8_t lo[FOLD_WINDOWS][16 * 64], hi[FOLD_WINDOWS][16 * 64];  // B tiles: 16 rows (64 inputs) x 64 bytes
};

// A super-block's codes of group g as B tiles, times the parts of their sub-block scales
template <int BITS>
inline void fold_super_block(const uint8_t* sb_codes, const uint8_t* sb_sc, FoldedSuperBlock* out) {
  constexpr int FOLD = fold_shift<BITS>();
  constexpr int64_t steps_per_sub = 32 / step_k<BITS>(), rows_per_step = step_k<BITS>() / 4;
  const __m512i lo_mask = _mm512_set1_epi32((1 << FOLD) - 1);
  for (int64_t sub = 0; sub < 8; ++sub) {
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb_sc + sub * LANES)));
    const __m512i lo = per_output_pairs(_mm512_and_si512(sc, lo_mask)), hi = per_output_pairs(_mm512_srli_epi32(sc, FOLD));
    uint8_t* lo_rows = out->lo[sub / 2] + (sub % 2) * 8 * 64;  // a sub-block is 8 of its window's 16 rows
    uint8_t* hi_rows = out->hi[sub / 2] + (sub % 2) * 8 * 64;
    for (int64_t c = 0; c < steps_per_sub; ++c) {
      __m512i rows[4];
      step_rows<BITS>(sb_codes + (sub * steps_per_sub + c) * step_bytes<BITS>(), rows);
      for (int64_t r = 0; r < rows_per_step; ++r) {
        _mm512_store_si512(lo_rows + (c * rows_per_step + r) * 64, _mm512_mullo_epi16(rows[r], lo));
        _mm512_store_si512(hi_rows + (c * rows_per_step + r) * 64, _mm512_mullo_epi16(rows[r], hi));
      }
    }
  }
}

// tiles 0, 1: A (a window's activation codes, rows x 64 bytes); 2, 3 and 4, 5: B lo and hi (folded
// codes, 16 rows x 64 bytes), for alternate windows; 6, 7: C lo and hi (a tile store costs the same
// for 2 rows as for 16: two stores a super-block, not four)
inline void configure_folded_tiles(int rows) {
  TileConfig cfg;
  for (int tile : {0, 1, 6, 7}) cfg.rows[tile] = rows, cfg.colsb[tile] = 64;
  for (int tile : {2, 3, 4, 5}) cfg.rows[tile] = 16, cfg.colsb[tile] = 64;
  load_tile_config(cfg);
}

// The activation codes as A tiles, once per product: chunks of R = min(16, M) rows, each 64-input
// window of a chunk R x 64 bytes in a row ([chunk][window][row][64]; rows past M zero), so that a
// tile load reads R x 64 bytes in a row where xq's rows, K bytes apart, missed L1 at every row
inline void pack_tile_activations(Acts& a, int64_t K, std::vector<int8_t>& storage) {
  const int64_t R = std::min<int64_t>(AMX_TILE_ROWS, a.M), chunks = (a.M + R - 1) / R, windows = K / 64;
  storage.assign(chunks * windows * R * 64, 0);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t w = 0; w < windows; ++w)
      std::memcpy(&storage[((m / R * windows + w) * R + m % R) * 64], a.xq + m * K + w * 64, 64);
  a.xt = storage.data(), a.xt_rows = R;
}

// one chunk's rows of one super-block (x: its first window's A tile) into sums[0] (lo), sums[1] (hi)
inline void folded_pass(const FoldedSuperBlock* b, const int8_t* x, int64_t tile_bytes, int32_t (*sums)[AMX_TILE_ROWS][LANES]) {
  _tile_zero(6);
  _tile_zero(7);
  for (int w = 0; w < 4; w += 2) {
    _tile_loadd(0, x + tile_bytes * w, 64);
    _tile_loadd(2, b->lo[w], 64);
    _tile_loadd(3, b->hi[w], 64);
    _tile_loadd(1, x + tile_bytes * (w + 1), 64);
    _tile_loadd(4, b->lo[w + 1], 64);
    _tile_loadd(5, b->hi[w + 1], 64);
    _tile_dpbsud(6, 0, 2);
    _tile_dpbsud(7, 0, 3);
    _tile_dpbsud(6, 1, 4);
    _tile_dpbsud(7, 1, 5);
  }
  _tile_stored(6, &sums[0][0][0], 64);
  _tile_stored(7, &sums[1][0][0], 64);
}

// C rows from t0: a super-block's integer sums (hi << FOLD + lo) into y, with the VNNI kernel's float
// operations in its order (group_tile_k, S = 32)
template <int C, int FOLD>
void folded_epilogue(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, int t0, int64_t sb,
                     int32_t (*sums)[AMX_TILE_ROWS][LANES], float* y, int64_t ldy, int64_t col0) {
  const int16_t* xs[C];
  for (int t = 0; t < C; ++t) xs[t] = sub_sums(a, L, r0 + t0 + t);
  __m512i icorr[C];
  const __m512 d = super_block_d(L, w, g, sb);
  const __m512 cc = k_correction_sums<C, 32>(L, w, g, sb, d, xs, icorr);
  for (int t = 0; t < C; ++t) {
    float* out = y + (r0 + t0 + t) * ldy + col0 + g * LANES;
    const __m512 dx = _mm512_set1_ps(act_scales(a, L, r0 + t0 + t)[sb]);
    const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[1][t0 + t]), FOLD),
                                          _mm512_load_si512(sums[0][t0 + t]));
    const __m512 o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(icorr[t]), _mm512_mul_ps(cc, dx), _mm512_loadu_ps(out));
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), o));
  }
}

struct FoldScratch {
  FoldedSuperBlock b[2];
  alignas(64) int32_t sums[2][2][AMX_TILE_ROWS][LANES];  // two passes': one's epilogue runs while the next one's tiles do
};
inline FoldScratch* fold_scratch() {
  thread_local FoldScratch scratch;
  return &scratch;
}

// every row of group g's outputs, Q4_K or Q5_K: passes (a super-block's chunk of rows through the
// tiles) in order; after each pass's tile instructions the previous pass's epilogue (whose sums
// are stored by then) and, after a super-block's first pass, the next super-block's folding (into
// the other buffer), so that nothing waits on the stores just issued. (The tiles and the vector
// units do not work at once on this project's Sapphire Rapids even so: docs/runner.md.)
template <int BITS>
void amx_group_folded(const Layout& L, const Weights& w, int64_t g, const Acts& a, float* y, int64_t ldy, int64_t col0) {
  constexpr int64_t sb_bytes = 256 / step_k<BITS>() * step_bytes<BITS>();
  const int64_t nsub = L.K / 32, super_blocks = L.K / L.SB, R = a.xt_rows, chunks = (a.M + R - 1) / R;
  const int64_t tile_bytes = R * 64, chunk_bytes = L.K / 64 * tile_bytes;
  const uint8_t* codes = w.codes + g * (L.K / step_k<BITS>()) * step_bytes<BITS>();
  const uint8_t* sc = w.sc + g * nsub * LANES;
  FoldScratch* scratch = fold_scratch();
  configure_folded_tiles((int)R);
  for (int64_t m = 0; m < a.M; ++m) _mm512_storeu_ps(y + m * ldy + col0 + g * LANES, _mm512_setzero_ps());
  auto epilogue = [&](int64_t pass) {
    const int64_t sb = pass / chunks, c = pass % chunks;
    by_row_chunks((int)std::min(R, a.M - c * R), [&](auto rows, int t0) {
      folded_epilogue<decltype(rows)::value, fold_shift<BITS>()>(L, w, g, a, c * R, t0, sb, scratch->sums[pass % 2], y, ldy, col0);
    });
  };
  fold_super_block<BITS>(codes, sc, &scratch->b[0]);
  for (int64_t pass = 0; pass < super_blocks * chunks; ++pass) {
    const int64_t sb = pass / chunks, c = pass % chunks;
    folded_pass(&scratch->b[sb % 2], a.xt + c * chunk_bytes + sb * 4 * tile_bytes, tile_bytes, scratch->sums[pass % 2]);
    if (c == 0 && sb + 1 < super_blocks) {
      const uint8_t* next = codes + (sb + 1) * sb_bytes;
      for (int64_t off = 0; off < sb_bytes; off += 64) _mm_prefetch((const char*)next + PREFETCH_BYTES + off, _MM_HINT_T0);
      fold_super_block<BITS>(next, sc + (sb + 1) * 8 * LANES, &scratch->b[(sb + 1) % 2]);
    }
    if (pass > 0) epilogue(pass - 1);
  }
  epilogue(super_blocks * chunks - 1);
}

inline bool folds_scales(const Layout& L) { return L.bits != 8 && L.has_sc && L.S == 32; }  // Q4_K, Q5_K

// Whether AMX multiplies this product (else the VNNI tiles do)
inline bool amx_takes(const Acts& a, const Layout& L) {
  if (amx_use == AmxUse::always) return a.M >= AMX_MIN_ROWS;
  return amx_use == AmxUse::wide && a.M >= AMX_AUTO_ROWS && folds_scales(L);
}

template <int BITS>
void amx_run_group(const Layout& L, const Weights& w, int64_t g, const Acts& a, float* y, int64_t ldy, int64_t col0) {
  if constexpr (BITS != 8) {
    if (folds_scales(L)) return amx_group_folded<BITS>(L, w, g, a, y, ldy, col0);
  }
  for (int64_t r = 0; r < a.M; r += AMX_ROWS) {
    const int T = (int)std::min<int64_t>(AMX_ROWS, a.M - r);
    if constexpr (BITS == 8) amx_group_legacy<BITS>(L, w, g, a, r, T, y, ldy, col0);
    else if (!L.has_sc) amx_group_legacy<BITS>(L, w, g, a, r, T, y, ldy, col0);
    else amx_group_k<BITS, 16>(L, w, g, a, r, T, y, ldy, col0);
  }
}
