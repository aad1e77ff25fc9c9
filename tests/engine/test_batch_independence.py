"""A request's tokens do not depend on the requests it shares forwards with.

The reference is each row run alone: a prompt fed by itself, in one piece, and a decode step
of one row. The same prompt fed beside longer ones (padded to their length), split into
prefill chunks, or stepped in a batch must give the same bits, in every dtype and weight form
specdec runs on the CPU (float32 and bfloat16 weights, a GGUF file's weights kept quantized).
Otherwise a seeded sampled request's tokens change with the load, and preemption (which
prefills a request again beside others) changes outputs. Then the engine: seeded requests
batched give the tokens they give alone, on tiny pairs and on SmolLM2 where it is fetched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_files import tiny_hf_model, write_gguf
from helpers import random_prompts, save_tiny_model
from specdec import LLM, SamplingParams
from specdec.kv_cache import TreeAttention
from specdec.models.cpu_linear import PackedLinear, can_pack
from specdec.models.loader import load_pretrained
from specdec.paths import SMOLLM2_GGUF
from specdec.tree import branches
from specdec.worker import ModelRunner
from specdec.worker.runner import ForwardBatch


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch-independence")
    return {
        "safetensors": save_tiny_model(root / "st", "llama", seed=3, init_std=0.3, max_position_embeddings=512),
        "gguf": write_gguf(root / "q4_1.gguf", tiny_hf_model("llama", seed=0), "Q4_1"),
    }


def runner_of(path: Path, dtype: str) -> ModelRunner:
    model = load_pretrained(path, dtype, load_tokenizer=False, keep_quantized=path.suffix == ".gguf").model
    runner = ModelRunner(model, compile="off")
    runner.prepare(max_batch=8, max_len=512, query_lengths=(1,), num_forwards=1)
    return runner


FORMS = [("safetensors", "float32"), ("safetensors", "bfloat16"), ("gguf", "float32")]


@pytest.mark.parametrize(("form", "dtype"), FORMS)
def test_a_prompt_fed_beside_longer_ones_gets_the_bits_it_gets_alone(models, form, dtype):
    """Prompts of 12, 300, 40 and 260 tokens fed in one forward (padded, or run in groups):
    each row's logits after its last token are exactly those of its own forward."""
    runner = runner_of(models[form], dtype)
    gen = torch.Generator().manual_seed(7)
    chunks = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (12, 300, 40, 260)]
    together = runner.feed(chunks, [0] * 4, [0, 1, 2, 3])  # [4, V]
    for row, chunk in enumerate(chunks):
        assert torch.equal(together[row], runner.feed([chunk], [0], [4 + row])[0]), f"row {row}"


@pytest.mark.parametrize(("form", "dtype"), FORMS)
def test_a_prompt_prefilled_in_chunks_gets_the_bits_of_one_piece(models, form, dtype):
    """A 200-token prompt fed as chunks of 5, 11, 37 and 147 tokens (some a decode-sized forward,
    some a prefill-sized one) ends with the logits of the prompt fed whole, and the next decode
    step from either cache gives the same bits too."""
    runner = runner_of(models[form], dtype)
    prompt = torch.randint(2, 250, (200,), generator=torch.Generator().manual_seed(8)).tolist()
    whole = runner.feed([prompt], [0], [0])[0]
    start = 0
    for length in (5, 11, 37, 147):
        chunked = runner.feed([prompt[start : start + length]], [start], [1])[0]
        start += length
    assert torch.equal(chunked, whole)
    assert torch.equal(runner.feed([[9]], [200], [1])[0], runner.feed([[9]], [200], [0])[0])


@pytest.mark.parametrize(("form", "dtype"), FORMS)
def test_a_decode_step_in_a_batch_gets_the_bits_of_the_step_alone(models, form, dtype):
    """Three cached prompts stepped together, one token each: each row's logits equal its own
    step's (the same token from the same cache, alone in the forward)."""
    runner = runner_of(models[form], dtype)
    prompts = random_prompts(3, seed=9, lengths=(20, 120), vocab=250)
    for slot, prompt in enumerate(prompts):
        runner.feed([prompt], [0], [slot])
        runner.feed([prompt], [0], [3 + slot])
    starts = [len(prompt) for prompt in prompts]
    together = runner.feed([[5], [6], [7]], starts, [0, 1, 2])  # [3, V]
    for row, start in enumerate(starts):
        assert torch.equal(together[row], runner.feed([[5 + row]], [start], [3 + row])[0]), f"row {row}"


@pytest.mark.parametrize(("form", "dtype"), FORMS)
def test_a_ragged_verify_runs_its_real_tokens_only_with_each_rows_bits(models, form, dtype):
    """A verify forward of chains of 6, 1 and 3 tokens, padded to [3, 6] with each row's length
    given (ForwardBatch.lengths): the model runs the 10 real tokens as one flat run [1, 10] (not
    18), each real position's logits are those of its row fed alone, and the padding's are zero."""
    runner = runner_of(models[form], dtype)
    prompts = random_prompts(3, seed=13, lengths=(20, 150), vocab=250)
    for slot, prompt in enumerate(prompts):
        runner.feed([prompt], [0], [slot])
        runner.feed([prompt], [0], [3 + slot])
    gen = torch.Generator().manual_seed(14)
    lengths = [6, 1, 3]
    chains = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in lengths]
    starts = [len(prompt) for prompt in prompts]
    input_ids = torch.zeros(3, 6, dtype=torch.long)
    for row, chain in enumerate(chains):
        input_ids[row, : len(chain)] = torch.tensor(chain)
    positions = torch.tensor(starts)[:, None] + torch.arange(6)  # [3, 6]
    seen = []
    hook = runner.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    try:
        logits = runner.forward(ForwardBatch.of(input_ids, positions, [0, 1, 2], lengths=lengths))  # [3, 6, V]
    finally:
        hook.remove()
    assert seen == [torch.Size([1, 10])]
    for row, (chain, start) in enumerate(zip(chains, starts)):
        alone = runner.forward(
            ForwardBatch.of(torch.tensor([chain]), torch.arange(start, start + len(chain))[None], [3 + row])
        )  # [1, n, V]
        assert torch.equal(logits[row, : len(chain)], alone[0]), f"row {row}"
        assert not logits[row, len(chain) :].any()


def tree_forward(token_ids: list[int], parents: list[int], start: int, width: int, slot: int) -> ForwardBatch:
    """A verify forward of one row's tree (the root token_ids[0] at start, its nodes
    token_ids[1:] with parents' columns in the nodes, -1 the root), padded to width nodes."""
    padded_parents = torch.tensor([parents + [-1] * (width - len(parents))])  # [1, width]
    visible = branches(padded_parents)  # [1, width + 1, width + 1]
    depth = visible.sum(-1) - 1  # [1, width + 1]
    columns = torch.arange(width + 1)
    tree = TreeAttention(start + columns[None], torch.tensor([start]), visible)
    input_ids = torch.tensor([token_ids + [0] * (width + 1 - len(token_ids))])
    return ForwardBatch.of(input_ids, start + depth, [slot], tree, [len(token_ids)])


@pytest.mark.parametrize(("form", "dtype"), FORMS)
def test_a_ragged_tree_verify_runs_its_real_nodes_only_with_each_rows_bits(models, form, dtype):
    """Trees of 5 and 2 nodes verified in one forward padded to [2, 6], each row's length given:
    the model runs their 9 real tokens as one run (the trees' layouts kept), and each node's
    logits are those of its tree verified alone, unpadded."""
    runner = runner_of(models[form], dtype)
    prompts = random_prompts(2, seed=15, lengths=(30, 90), vocab=250)
    for slot, prompt in enumerate(prompts):
        runner.feed([prompt], [0], [slot])
        runner.feed([prompt], [0], [2 + slot])
    trees = [([7, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 2]), ([8, 21, 22], [-1, 0])]  # (root + nodes, parents)
    alone = [
        runner.forward(tree_forward(ids, parents, len(prompts[row]) - 1, len(parents), 2 + row))
        for row, (ids, parents) in enumerate(trees)  # each tree alone, unpadded: [1, its nodes + 1]
    ]
    rows = [tree_forward(ids, parents, len(prompts[row]) - 1, 5, row) for row, (ids, parents) in enumerate(trees)]
    batch = ForwardBatch.of(
        torch.cat([r.input_ids for r in rows]),
        torch.cat([r.positions for r in rows]),
        [0, 1],
        TreeAttention(
            *(torch.cat([getattr(r.tree, f) for r in rows]) for f in ("write_positions", "tree_start", "visible"))
        ),
        [6, 3],
    )
    seen = []
    hook = runner.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    try:
        logits = runner.forward(batch)  # [2, 6, V]
    finally:
        hook.remove()
    assert seen == [torch.Size([1, 9])]
    for row, (ids, _) in enumerate(trees):
        assert torch.equal(logits[row, : len(ids)], alone[row][0, : len(ids)]), f"row {row}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "out_features"), [(256, 768), (1536, 1536), (8960, 1536)])
def test_a_packed_linear_gives_each_row_the_bits_it_gets_alone(dtype, in_features, out_features):
    """The oneDNN-prepacked product (what the CPU's eager path runs): 1 to 100 rows at once,
    each row's output is exactly its product alone. The larger shapes are a 1.5B model's (on a
    Sapphire Rapids oneDNN's own products differ there: cpu_linear.ProductShape)."""
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN does not pack {dtype} linears on this CPU")
    g = torch.Generator().manual_seed(10)
    linear = torch.nn.Linear(in_features, out_features, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g))
        packed = PackedLinear(linear)
        x = torch.randn(100, in_features, generator=g).to(dtype)
        alone = torch.cat([packed(x[i : i + 1]) for i in range(100)])  # [100, N]
        for rows in (2, 3, 8, 17, 32, 33, 64, 100):
            assert torch.equal(packed(x[:rows]), alone[:rows]), f"{rows} rows"
        assert torch.equal(packed(x[:33].view(3, 11, in_features)), alone[:33].view(3, 11, out_features))


def seeded_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(n)]


def batched_and_alone(llm: LLM, prompts, params) -> tuple[list[list[int]], list[list[int]]]:
    batched = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    alone = [llm.generate([prompt], p)[0].outputs[0].token_ids for prompt, p in zip(prompts, params)]
    return batched, alone


@pytest.mark.parametrize(("form", "dtype"), FORMS)
def test_seeded_sampled_requests_give_the_same_tokens_batched_and_alone(models, form, dtype):
    """Eight seeded sampled requests of 10 to 300 prompt tokens, with prompt lookup drafting
    (k = 4): served together, each gives the tokens it gives served alone."""
    llm = LLM(
        str(models[form]),
        dtype=dtype,
        compile="off",
        max_num_seqs=8,
        speculative_method="ngram",
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
        enable_prefix_caching=False,
    )
    prompts = random_prompts(8, seed=12, lengths=(10, 300), vocab=250)
    batched, alone = batched_and_alone(llm, [{"prompt_token_ids": p} for p in prompts], seeded_params(8))
    assert batched == alone


@pytest.mark.skipif(
    not SMOLLM2_GGUF.is_file(), reason=f"{SMOLLM2_GGUF} is not there: `make smollm2` fetches it (pip, ~100 MB)"
)
def test_smollm2_seeded_requests_give_the_same_tokens_batched_and_alone():
    """The real GGUF (Q4_1, kept quantized) with models/smollm2-draft: six seeded sampled code
    prompts served together give the tokens each gives alone (before prefills ran every
    length through one kernel, 20 of 30 such requests differed)."""
    from specdec.tools.benchmark.prompts import held_out_code_prompts

    llm = LLM(
        str(SMOLLM2_GGUF),
        dtype="float32",
        max_num_seqs=6,
        speculative_model=str(Path(__file__).resolve().parents[2] / "models" / "smollm2-draft"),
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
    )
    prompts = [prompt.text for prompt in held_out_code_prompts(max_chars=700)[:6]]
    batched, alone = batched_and_alone(llm, prompts, seeded_params(6))
    assert batched == alone


def test_where_onednn_packs_no_bfloat16_products_run_as_they_come(monkeypatch):
    """A CPU without native bfloat16 (AVX2): nothing to probe, no error (oneDNN refuses to pack)."""
    from specdec.models import cpu_linear

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    cpu_linear.rows_per_product.cache_clear()
    try:
        assert cpu_linear.rows_per_product(torch.bfloat16) == cpu_linear.ProductShape()
    finally:
        cpu_linear.rows_per_product.cache_clear()
