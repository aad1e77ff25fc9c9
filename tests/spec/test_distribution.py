"""Sampled speculative output follows the target's warped distribution exactly, end to end
through specdec.LLM, for every drafter; and a seeded request does not depend on its batch.

The exact distributions come from outside the engine: transformers' model for the logits and
a reference warper written here from the definitions in specdec/sampling.py's docstring.

The engine samples the first generated token from the prefill forward (plain sampling); the
following ones come out of speculative rounds (accepted drafts, recovered and bonus tokens).
A round never drafts past max_tokens (a row with r tokens left verifies at most r - 1 drafts),
so max_tokens must be at least 3 for any draft to be verified: with max_tokens = 3 the second
token is an accepted or recovered first draft, the third a bonus token or a plain round's.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from helpers import load_hf, save_random_head, save_tiny_model
from specdec import LLM, SamplingParams
from specdec.tools.benchmark.chi_square import chi_square_p_value

VOCAB = 32
# A very small model: the cost of these tests is NUM_DRAWS rows through the engine, not the model.
DIMS = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
K = 3
NUM_DRAWS = 60_000  # rows per chi-square test: enough power for them, and the suite stays under 10 minutes
MAX_TOKENS = 3  # the first token from the prefill, then draft-verified ones
MARGIN = 1e-5  # a top-k / top-p / min-p decision this close to its threshold could go either way

SETTINGS = {
    "T1.0": dict(temperature=1.0),
    "T0.7-top_k5": dict(temperature=0.7, top_k=5),
    "T1.3-top_p0.8": dict(temperature=1.3, top_p=0.8),
    "T1.0-min_p0.1": dict(temperature=1.0, min_p=0.1),
    "T0.9-top_k8-top_p0.9-min_p0.05": dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
}
# Three of the five settings per drafter, to stay near 2 minutes on 2 cores: NUM_DRAWS draws
# cost 11-20 s per run, nearly all of it the engine's per-row Python work. Each drafter gets
# top_k, top_p and min_p (all three together, plus single ones); every setting runs once.
RUNS = {
    "draft_model": ["T0.7-top_k5", "T1.0-min_p0.1", "T0.9-top_k8-top_p0.9-min_p0.05"],
    "ngram": ["T1.0", "T1.3-top_p0.8", "T0.9-top_k8-top_p0.9-min_p0.05"],
    "eagle": ["T0.9-top_k8-top_p0.9-min_p0.05"],  # an untrained head: its distributions are the target's
    # output layer over features it got wrong, over HEAD_SCORED of the tokens (sampled over those alone)
    "draft_model_tree": ["T1.3-top_p0.8"],  # a tree: here 3 siblings, judged one after another
    # prompt lookup where a row's looked-up tokens have fared as well as the draft model's, the
    # draft model elsewhere: each row's proposal chosen from its own earlier rounds
    "lookup_then_draft": ["T1.0"],
    # suffix decoding: point masses from the prompt and from the other draws' outputs as they grow
    "suffix": ["T0.7-top_k5"],
    # suffix decoding where it matches, the draft model elsewhere, in one round
    "suffix_then_draft": ["T1.0-min_p0.1"],
}
TREE = dict(speculative_tree="3,2", num_speculative_tokens=5)
# adaptive k (a row stops drafting after a draft token of draft probability < this): only in
# the seeded-request test, since the distribution tests' one round proposes a single token
CONFIDENCE_THRESHOLD = 0.3
HEAD_SCORED = 24  # the head scores tokens 0..23 of the 32 (FR-Spec style): it never drafts the others


# ---------------------------------------------------------------------------------------------
# Models, prompt and the exact distributions.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target over 32 tokens; a draft that is a different random model (the target's
    weights plus independent noise of a fifth of their size, so that 10-50% of drafts are
    accepted, depending on the setting); and a prompt that is the target's own greedy
    continuation of one token, so it repeats and prompt lookup finds likely next tokens in it."""
    root = tmp_path_factory.mktemp("distribution")
    target_dir = save_tiny_model(
        root / "target", "llama", seed=7, vocab_size=VOCAB, tokenizer=False, init_std=0.5, **DIMS
    )
    target = load_hf(target_dir)
    draft = load_hf(target_dir)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.2 * param.std().clamp(min=0.1))
    draft_dir = root / "draft"
    draft.save_pretrained(draft_dir)

    prompt = [5]
    with torch.no_grad():
        for _ in range(7):
            prompt.append(int(target(torch.tensor([prompt])).logits[0, -1].argmax()))
    head_dir = save_random_head(target_dir, root / "head", seed=6, output_vocab=HEAD_SCORED)
    return dict(
        target=str(target_dir),
        draft=str(draft_dir),
        head=str(head_dir),
        prompt=prompt,
        logits=continuation_logits(target, prompt, MAX_TOKENS),
    )


def continuation_logits(target, prompt: list[int], T: int) -> np.ndarray:
    """The target's logits after the prompt followed by every possible (x_1 .. x_{T-1}):
    [V^(T-1), T, V], in itertools.product order."""
    continuations = torch.tensor(list(itertools.product(range(VOCAB), repeat=T - 1)), dtype=torch.long)
    input_ids = torch.cat([torch.tensor(prompt).expand(len(continuations), -1), continuations], dim=1)
    with torch.no_grad():
        return torch.cat(
            [target(chunk).logits[:, len(prompt) - 1 :].float() for chunk in input_ids.split(8192)]
        ).numpy()


def reference_warp(
    logits: np.ndarray, temperature: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """logits [N, V] -> (probs [N, V] in float64, margins [N]: per row, the smallest distance
    of any top-k / top-p / min-p decision from its threshold). From the definitions:
    temperature; top_k keeps logits >= the k-th largest; top_p keeps the tokens whose mass
    before them, in descending order, is < top_p; min_p drops probabilities < min_p * the
    largest; renormalise."""
    z = logits.astype(np.float64) / temperature
    N, V = z.shape
    keep = np.ones((N, V), dtype=bool)
    margins = np.full(N, np.inf)
    if 0 < top_k < V:
        descending = -np.sort(-z, axis=1)
        kth = descending[:, top_k - 1 : top_k]
        keep &= z >= kth
        margins = np.minimum(margins, kth[:, 0] - descending[:, top_k])
    if top_p < 1:
        probs = softmax_where(z, keep)
        for n in range(N):
            mass_before = 0.0
            for token in np.argsort(-probs[n], kind="stable"):
                if not keep[n, token]:
                    continue
                margins[n] = min(margins[n], abs(mass_before - top_p))
                if mass_before >= top_p:
                    keep[n, token] = False
                mass_before += probs[n, token]
    probs = softmax_where(z, keep)
    if min_p > 0:
        threshold = min_p * probs.max(axis=1, keepdims=True)
        margins = np.minimum(margins, np.where(keep, np.abs(probs - threshold), np.inf).min(axis=1))
        keep &= probs >= threshold
        probs = softmax_where(z, keep)
    return probs, margins


def softmax_where(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    z = np.where(keep, z, -np.inf)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def exact_distributions(logits: np.ndarray, setting: dict) -> list[np.ndarray]:
    """The exact joint distribution of the first t generated tokens, for t = 1..T, each as an
    array [V] * t (from logits [V^(T-1), T, V] over all continuations, in itertools.product
    order)."""
    count, T, V = logits.shape
    warped, margins = reference_warp(logits.reshape(-1, V), **setting)
    warped, margins = warped.reshape(count, T, V), margins.reshape(count, T)
    joints, ambiguous = [], 0.0
    for t in range(1, T + 1):
        # rows whose first t-1 continuation tokens differ are the contexts of token t
        contexts = warped[:: V ** (T - t), t - 1]  # [V^(t-1), V]: p(x_t | x_1 .. x_{t-1})
        previous = joints[-1].reshape(-1) if joints else np.ones(1)  # P(x_1 .. x_{t-1})
        joints.append((previous[:, None] * contexts).reshape((V,) * t))
        ambiguous += previous[margins[:: V ** (T - t), t - 1] < MARGIN].sum()
    # where float32 rounding could tip a decision, the contexts must be too rare to matter
    assert ambiguous < 1e-4, f"contexts of probability {ambiguous:.1e} sit on a warping threshold: pick other seeds"
    return joints


# ---------------------------------------------------------------------------------------------
# Chi-square.
# ---------------------------------------------------------------------------------------------


def assert_follows(samples: np.ndarray, probs: np.ndarray, what: str) -> None:
    p_value = chi_square_p_value(samples, probs, what)
    assert p_value > 1e-3, f"{what}: chi-square p-value {p_value:.2e} over {len(samples)} draws"


# ---------------------------------------------------------------------------------------------
# The tests.
# ---------------------------------------------------------------------------------------------


def make_llm(setup, drafter: str, **kwargs) -> LLM:
    speculative_model = {"ngram": "[ngram]", "eagle": setup["head"], "suffix": None}.get(drafter, setup["draft"])
    if drafter in ("eagle", "lookup_then_draft", "suffix", "suffix_then_draft"):
        kwargs["speculative_method"] = drafter
    if drafter == "draft_model_adaptive":
        kwargs["draft_confidence_threshold"] = CONFIDENCE_THRESHOLD
    if drafter == "draft_model_tree":
        kwargs.update(TREE)
    kwargs.setdefault("speculative_k_policy", "fixed")  # k every round: these tests count what was drafted
    kwargs.setdefault("num_speculative_tokens", K)
    return LLM(
        setup["target"], speculative_model=speculative_model, dtype="float32", skip_tokenizer_init=True, **kwargs
    )


@pytest.fixture(scope="module")
def llms(setup):
    return {drafter: make_llm(setup, drafter, max_num_seqs=NUM_DRAWS, seed=1000 + i) for i, drafter in enumerate(RUNS)}


def test_reference_warper_matches_the_definitions():
    """The test's own warper, on a hand-checked example."""
    logits = np.log(np.array([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    probs, _ = reference_warp(logits, 1.0, top_k=3)
    np.testing.assert_allclose(probs[0], [0, 0.4, 0, 0.3, 0.15] / np.float64(0.85))
    probs, _ = reference_warp(logits, 1.0, top_p=0.75)  # masses before: .4: 0, .3: .4, .15: .7, .1: .85
    np.testing.assert_allclose(probs[0], [0, 0.4, 0, 0.3, 0.15] / np.float64(0.85))
    probs, _ = reference_warp(logits, 1.0, min_p=0.3)  # drops < 0.12
    np.testing.assert_allclose(probs[0], [0, 0.4, 0, 0.3, 0.15] / np.float64(0.85))
    probs, _ = reference_warp(logits, 0.5)
    np.testing.assert_allclose(probs[0], np.array([0.05, 0.4, 0.1, 0.3, 0.15]) ** 2 / 0.285)
    probs, _ = reference_warp(logits, 1.0, top_k=4, top_p=0.7, min_p=0.5)  # top_k: .4 .3 .15 .1
    np.testing.assert_allclose(probs[0], [0, 0.4, 0, 0.3, 0] / np.float64(0.7))  # top_p keeps .4 .3


@pytest.mark.parametrize(
    "setting, logits, expected",
    [
        (dict(top_k=2), [0.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]),  # ties at the k-th are kept
        (dict(top_p=0.5), [0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]),  # mass before < top_p: strict
        (dict(min_p=1.0), [0.0, 0.0, -1.0], [0.5, 0.5, 0.0]),  # min_p 1 keeps the most likely (ties too)
        (dict(top_k=1, top_p=0.3, min_p=0.9), [2.0, 1.0, 0.0], [1.0, 0.0, 0.0]),
    ],
)
def test_warping_at_its_exact_boundaries(setting, logits, expected):
    """The boundary rules of the definitions, on inputs that sit exactly on them."""
    from specdec.sampling import SamplingTensors, warp

    tensors = SamplingTensors.from_params([SamplingParams(temperature=1.0, **setting)])
    probs = warp(torch.tensor([logits]), tensors)[0]
    reference, _ = reference_warp(np.array([logits]), 1.0, **setting)
    np.testing.assert_allclose(probs.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(reference[0], expected, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_top_p_over_a_realistic_vocabulary(seed):
    """Rows from flat to peaked over 8,192 tokens, logits rounded to bfloat16 (so with ties),
    every combination of top_k and top_p: the probabilities sort exactly as a stable sort
    sorts them, and the warped distributions are the reference's."""
    from specdec.sampling import SamplingTensors, sorted_descending, warp

    generator = torch.Generator().manual_seed(seed)
    V, scales = 8192, (0.3, 1.0, 3.0, 6.0, 12.0)
    settings = [dict(top_k=k, top_p=p) for k in (-1, 1, 5, 40, 64, 100, 2000) for p in (1.0, 0.5, 0.9, 0.95)]
    rows = [(scale, setting) for scale in scales for setting in settings]
    logits = torch.stack([torch.randn(V, generator=generator) * scale for scale, _ in rows])
    logits = logits.to(torch.bfloat16).float()  # [N, V]
    logits[::7, -100:] = float("-inf")  # some probabilities exactly 0

    probs = torch.softmax(logits, dim=-1)
    values, ids = sorted_descending(probs)
    expected_values, expected_ids = probs.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)

    tensors = SamplingTensors.from_params([SamplingParams(temperature=1.0, **setting) for _, setting in rows])
    warped = warp(logits, tensors)
    for row, (_, setting) in enumerate(rows):
        expected, margin = reference_warp(logits[row : row + 1].double().numpy(), 1.0, **setting)
        if margin[0] > 1e-5:  # a decision this close to its threshold may round either way
            np.testing.assert_allclose(warped[row].double().numpy(), expected[0], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_top_p_from_the_candidates_is_bit_for_bit_the_full_sorts(seed, monkeypatch):
    """warp sorts only the CANDIDATES likeliest tokens where every row's kept prefix ends among
    them, else the whole row: rows from flat (a nucleus of thousands: the whole row) to peaked,
    with ties (bfloat16 logits), top_k below and above CANDIDATES, in one batch and row by row.
    The output equals warp's with the partial sort switched off, bit for bit; the partial sort
    is the full sort's first columns."""
    from specdec import sampling

    generator = torch.Generator().manual_seed(seed)
    V = 20_000
    settings = [dict(top_k=k, top_p=p) for k in (-1, 5, 500, 1500) for p in (1.0, 0.9, 0.95)]
    rows = [(scale, setting) for scale in (0.5, 4.0, 10.0) for setting in settings]
    logits = torch.stack([torch.randn(V, generator=generator) * scale for scale, _ in rows])
    logits = logits.to(torch.bfloat16).float()  # [N, V]: ties
    probs = torch.softmax(logits, dim=-1)
    values, ids = sampling.sorted_descending(probs)
    first_values, first_ids = sampling.sorted_descending(probs, sampling.CANDIDATES)
    assert torch.equal(first_values, values[:, : sampling.CANDIDATES])
    assert torch.equal(first_ids, ids[:, : sampling.CANDIDATES])

    tensors = sampling_tensors(rows)
    batched = sampling.warp(logits, tensors)
    one_by_one = [sampling.warp(logits[r : r + 1], sampling_tensors(rows[r : r + 1])) for r in range(len(rows))]
    monkeypatch.setattr(sampling, "CANDIDATES", V)  # the whole row, always
    assert torch.equal(batched, sampling.warp(logits, tensors))
    for r in range(len(rows)):
        assert torch.equal(one_by_one[r], sampling.warp(logits[r : r + 1], sampling_tensors(rows[r : r + 1])))


@pytest.mark.parametrize("seed", [0, 1])
def test_top_p_from_the_tokens_above_a_threshold_is_bit_for_bit_the_full_sort(seed, monkeypatch):
    """top_p alone sorts first the tokens above NUCLEUS_SHARE of each row's likeliest, where they
    hold the nucleus: peaked rows (the threshold path taken), with ties (bfloat16 logits), rows
    without top_p among them, and a batch with one row whose nucleus reaches past the threshold
    (half its mass on one token, half on a flat tail: the candidates' path instead). Each
    output equals warp's with every partial sort switched off, bit for bit, in one batch and
    row by row."""
    from specdec import sampling

    generator = torch.Generator().manual_seed(seed)
    V = 20_000
    rows = [(scale, dict(top_p=p)) for scale in (6.0, 10.0, 14.0) for p in (1.0, 0.8, 0.95)]
    logits = torch.stack([torch.randn(V, generator=generator) * scale for scale, _ in rows])
    logits = logits.to(torch.bfloat16).float()  # [N, V]: ties
    flat = torch.randn(1, V, generator=generator) * 0.01  # half its mass on one token, half on a tail of
    flat[0, 0] = 0.8 * math.log(2 * V)  # tokens each ~1/(2V) of it: below the threshold, needed by top_p 0.9
    taken = []
    threshold_path = sampling._nucleus_above_threshold
    monkeypatch.setattr(
        sampling,
        "_nucleus_above_threshold",
        lambda p, s: taken.append(threshold_path(p, s) is not None) or threshold_path(p, s),
    )
    cases = [(logits, rows), (torch.cat([logits, flat]), [*rows, (0.5, dict(top_p=0.9))])]
    outputs = [sampling.warp(x, sampling_tensors(r)) for x, r in cases]
    one_by_one = [sampling.warp(logits[i : i + 1], sampling_tensors(rows[i : i + 1])) for i in range(len(rows))]
    assert taken[0] and not taken[1] and all(taken[2:]), taken
    monkeypatch.setattr(sampling, "CANDIDATES", V)  # the whole row, always
    for (x, r), output in zip(cases, outputs):
        assert torch.equal(output, sampling.warp(x, sampling_tensors(r)))
    for i in range(len(rows)):
        assert torch.equal(one_by_one[i], sampling.warp(logits[i : i + 1], sampling_tensors(rows[i : i + 1])))


def sampling_tensors(rows):
    from specdec.sampling import SamplingTensors

    return SamplingTensors.from_params([SamplingParams(temperature=0.8, **setting) for _, setting in rows])


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("scored", [False, True])
def test_a_sharpened_draft_is_drawn_from_and_scored_by_the_same_distribution(scale, scored):
    """DraftSteps with a temperature_scale: a sampled row's draft probabilities are the request's
    warping at temperature x scale (the definitions' reference), its tokens are drawn from them
    (a chi-square test over many rows), and a greedy row still takes the argmax. Scored: the
    drafter's scores cover only some vocabulary ids (an EAGLE head's output_token_ids), and the
    draft is the one that logits of -inf for the others would give."""
    from specdec.drafters.steps import DraftSteps
    from specdec.sampling import SamplingTensors
    from specdec.sequence import Sequence

    rng = np.random.default_rng(7)
    vocab_size = 20
    scored_ids = torch.tensor([0, 2, 3, 5, 8, 9, 11, 13, 14, 16, 17, 19]) if scored else None
    width = len(scored_ids) if scored_ids is not None else vocab_size
    scores = torch.from_numpy(rng.normal(0, 1.5, size=(1, width))).float()
    logits = torch.full((1, vocab_size), float("-inf"))  # what the drafter's scores mean
    logits[:, scored_ids if scored_ids is not None else slice(None)] = scores
    sampled, greedy = SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=0.0)
    rows = 4000
    params = [sampled] * rows + [greedy]
    batch = [Sequence(str(i), [0], p, torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    sampling = SamplingTensors.from_params(params)
    steps = DraftSteps(batch, [1] * len(batch), sampling, 0.0, torch.device("cpu"), scale, scored_ids, vocab_size)
    tokens = steps.draw(scores.expand(len(batch), -1)).numpy()
    expected, _ = reference_warp(logits.numpy(), 0.9 * scale, top_p=0.9)
    probs = steps.draft().probs
    assert probs is not None and probs.shape == (len(batch), 1, vocab_size)
    np.testing.assert_allclose(probs[0, 0].numpy(), expected[0], atol=1e-6)
    assert tokens[-1] == int(logits.argmax())
    assert_follows(tokens[:-1], expected[0], f"draft tokens at scale {scale}")


@pytest.mark.slow
@pytest.mark.parametrize("drafter,setting", [(d, s) for d, settings in RUNS.items() for s in settings])
def test_sampled_tokens_follow_the_target(setup, llms, drafter, setting):
    """Over NUM_DRAWS copies of one prompt: the first, second and third generated tokens each
    follow their exact marginal, and the tokens jointly follow the exact joint distribution;
    drafts were both accepted and rejected along the way."""
    joints = exact_distributions(setup["logits"], SETTINGS[setting])
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **SETTINGS[setting])
    outputs = llms[drafter].generate([setup["prompt"]] * NUM_DRAWS, params)
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, T]
    assert tokens.shape == (NUM_DRAWS, MAX_TOKENS)

    proposed = sum(out.metrics.num_draft_tokens for out in outputs)
    accepted = sum(out.metrics.num_accepted_tokens for out in outputs)
    assert proposed >= NUM_DRAWS // 4, f"only {proposed} draft tokens were verified"
    assert 1000 < accepted < proposed - 1000, f"{accepted} of {proposed} drafts accepted: one path untested"

    T, V = MAX_TOKENS, VOCAB
    for t in range(T):
        marginal = joints[-1].sum(axis=tuple(i for i in range(T) if i != t))
        assert_follows(tokens[:, t], marginal, f"{drafter} {setting}: token {t + 1}")
    assert_follows(np.ravel_multi_index(tokens.T, (V,) * T), joints[-1], f"{drafter} {setting}: joint")


@pytest.mark.slow
def test_n_completions_of_a_request_follow_the_target_each_on_its_own(setup, llms):
    """SamplingParams.n (vLLM's parallel sampling) under the draft model: 125 requests of 120
    completions each (15,000 draws, the shared random stream, no seed): the completions' tokens
    follow the exact joint, and two sibling completions are independent (their first tokens
    follow the product of the exact marginal with itself, as two requests' would)."""
    setting = SETTINGS["T1.0-min_p0.1"]
    joints = exact_distributions(setup["logits"], setting)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=120, **setting)
    outputs = llms["draft_model"].generate([setup["prompt"]] * 125, params)
    tokens = np.array([[c.token_ids for c in out.outputs] for out in outputs])  # [requests, n, T]
    assert tokens.shape == (125, 120, MAX_TOKENS)
    flat = tokens.reshape(-1, MAX_TOKENS)
    assert_follows(np.ravel_multi_index(flat.T, (VOCAB,) * MAX_TOKENS), joints[-1], "n completions: joint")
    siblings = tokens[:, 0::2, 0] * VOCAB + tokens[:, 1::2, 0]  # completions 2j and 2j + 1 of a request
    assert_follows(siblings, np.outer(joints[0], joints[0]).reshape(-1), "sibling completions' first tokens")


@pytest.mark.slow
def test_two_drafts_in_one_round_follow_the_target(setup, llms):
    """max_tokens 4: after the prefill's token, one round verifies two draft tokens, the second
    judged with its own draft distribution, then a recovered or bonus token. The four tokens
    follow their exact marginals and the first three their exact joint."""
    T, V, setting = 4, VOCAB, SETTINGS["T0.7-top_k5"]
    joints = exact_distributions(continuation_logits(load_hf(setup["target"]), setup["prompt"], T), setting)
    params = SamplingParams(max_tokens=T, ignore_eos=True, **setting)
    outputs = llms["draft_model"].generate([setup["prompt"]] * NUM_DRAWS, params)
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, 4]
    second_judged = sum(
        out.metrics.proposed_by_position[1]
        for out in outputs
        if len(out.metrics.proposed_by_position) > 1 and out.metrics.accepted_by_position[:1] == [1]
    )
    assert second_judged > NUM_DRAWS // 10, f"only {second_judged} second drafts were judged"
    for t in range(T):
        marginal = joints[-1].sum(axis=tuple(i for i in range(T) if i != t))
        assert_follows(tokens[:, t], marginal, f"draft_model two drafts: token {t + 1}")
    assert_follows(np.ravel_multi_index(tokens[:, :3].T, (V,) * 3), joints[2], "draft_model two drafts: joint of 3")


@pytest.mark.slow
def test_a_tree_two_deep_follows_the_target(setup, llms):
    """max_tokens 4: after the prefill's token, one round verifies a tree of 5 nodes, two deep
    (3 children of the last token, 2 of each of those, the 5 likeliest kept): the second
    token is a first-level node or the residual after its rejected siblings, the third a
    second-level node, a residual, or a bonus token. The four tokens follow their exact
    marginals and the first three their exact joint."""
    T, V, setting = 4, VOCAB, SETTINGS["T0.7-top_k5"]
    joints = exact_distributions(continuation_logits(load_hf(setup["target"]), setup["prompt"], T), setting)
    params = SamplingParams(max_tokens=T, ignore_eos=True, **setting)
    outputs = llms["draft_model_tree"].generate([setup["prompt"]] * NUM_DRAWS, params)
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, 4]
    two_accepted = sum(out.metrics.num_accepted_tokens == 2 for out in outputs)
    assert two_accepted > NUM_DRAWS // 50, f"only {two_accepted} rows accepted a second-level node"
    for t in range(T):
        marginal = joints[-1].sum(axis=tuple(i for i in range(T) if i != t))
        assert_follows(tokens[:, t], marginal, f"draft_model tree: token {t + 1}")
    assert_follows(np.ravel_multi_index(tokens[:, :3].T, (V,) * 3), joints[2], "draft_model tree: joint of 3")


@pytest.mark.slow
def test_sampled_tokens_follow_the_quantized_target(setup):
    """Lossless with respect to the quantized target: int8 target weights, the draft's int4,
    and the tokens follow the exact distribution of the int8 model (its own plain forward over
    every continuation, warped by the reference warper)."""
    setting = SETTINGS["T1.0"]
    llm = make_llm(
        setup, "draft_model", quantization="int8", draft_quantization="int4", max_num_seqs=NUM_DRAWS, seed=77
    )
    joints = exact_distributions(continuation_logits(LogitsOf(llm.runner.model), setup["prompt"], MAX_TOKENS), setting)
    outputs = llm.generate(
        [setup["prompt"]] * NUM_DRAWS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **setting)
    )
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, T]
    accepted = sum(out.metrics.num_accepted_tokens for out in outputs)
    assert 1000 < accepted < sum(out.metrics.num_draft_tokens for out in outputs) - 1000
    T, V = MAX_TOKENS, VOCAB
    for t in range(T):
        marginal = joints[-1].sum(axis=tuple(i for i in range(T) if i != t))
        assert_follows(tokens[:, t], marginal, f"int8 target: token {t + 1}")
    assert_follows(np.ravel_multi_index(tokens.T, (V,) * T), joints[-1], "int8 target: joint")


@pytest.mark.slow
def test_a_draft_scoring_part_of_the_vocabulary_keeps_the_target_distribution(setup, tmp_path):
    """A draft whose output layer scores 12 of the 32 tokens (FR-Spec style: the others get
    q = 0 and are never drafted) still gives the target's exact distribution, since the target
    verifies: tokens outside the draft's 12 come out of recovery and bonus samples."""
    import dataclasses

    from specdec.models.checkpoint import save_pretrained
    from specdec.models.llama import LlamaModel
    from specdec.models.loader import load_pretrained

    full = load_pretrained(setup["draft"], "float32", load_tokenizer=False).model
    scored = torch.tensor(sorted(set(setup["prompt"]) | set(range(0, VOCAB, 4))))[:12]  # ascending ids
    config = dataclasses.replace(full.config, output_vocab_size=len(scored), tie_word_embeddings=False)
    part = LlamaModel(config)
    state = {name: tensor for name, tensor in full.state_dict().items() if name != "lm_head.weight"}
    part.load_state_dict({**state, "lm_head.weight": full.lm_head.weight[scored], "output_token_ids": scored})
    ids = torch.tensor([setup["prompt"]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        full_logits, part_logits = full(ids, positions, None), part(ids, positions, None)  # [1, T, V] each
    unscored = torch.ones(VOCAB, dtype=torch.bool).index_fill(0, scored, False)
    assert torch.allclose(part_logits[..., scored], full_logits[..., scored], atol=1e-5)  # a narrower matmul
    assert bool((part_logits[..., unscored] == float("-inf")).all())
    draft_dir = save_pretrained(part, tmp_path / "part_draft", torch.float32)
    setting = SETTINGS["T1.0"]
    llm = LLM(
        setup["target"],
        speculative_model=str(draft_dir),
        num_speculative_tokens=K,
        dtype="float32",
        skip_tokenizer_init=True,
        speculative_k_policy="fixed",
        max_num_seqs=NUM_DRAWS,
        seed=31,
    )
    outputs = llm.generate(
        [setup["prompt"]] * NUM_DRAWS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **setting)
    )
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, T]
    assert 1000 < sum(out.metrics.num_accepted_tokens for out in outputs)
    assert not np.isin(tokens[:, 1], scored.numpy()).all()  # the target does emit tokens the draft cannot score
    joints = exact_distributions(setup["logits"], setting)
    for t in range(MAX_TOKENS):
        marginal = joints[-1].sum(axis=tuple(i for i in range(MAX_TOKENS) if i != t))
        assert_follows(tokens[:, t], marginal, f"draft over part of the vocabulary: token {t + 1}")


class LogitsOf:
    """specdec's model called as transformers' is, model(input_ids).logits, for continuation_logits."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids: torch.Tensor):
        from types import SimpleNamespace

        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)  # [N, T]
        with torch.no_grad():
            return SimpleNamespace(logits=self.model(input_ids, positions, None))


OTHER_PROMPTS = [[7, 3, 9, 7, 3, 9, 7, 3], [11, 2], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4], [30, 1, 17, 30, 1]]


@pytest.mark.parametrize("drafter", [*RUNS, "draft_model_adaptive"])
def test_seeded_request_is_independent_of_its_batch(setup, drafter):
    """The same seeded request alone, in a batch with other seeded and unseeded requests of
    other prompts and settings, twice in one batch, and queued behind others for a slot."""
    seeded = SamplingParams(temperature=1.0, max_tokens=20, seed=4321, ignore_eos=True)
    prompt = setup["prompt"]
    llm = make_llm(setup, drafter)
    alone = llm.generate([prompt], seeded)[0]
    assert alone.metrics.num_draft_tokens > 0
    # a seeded row's suffix drafts come from its own text alone, seldom what T 1.0 samples here
    assert alone.metrics.num_accepted_tokens > 0 or drafter == "suffix"
    if drafter == "draft_model_adaptive":  # rounds that stopped drafting early, and rounds that did not
        by_position = alone.metrics.proposed_by_position
        assert by_position[0] > by_position[-1] > 0

    others = [
        SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=6, max_tokens=30, seed=99, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.1, top_p=0.9, max_tokens=25, ignore_eos=True),
    ]
    prompts = [OTHER_PROMPTS[0], prompt, OTHER_PROMPTS[1], OTHER_PROMPTS[2], prompt, OTHER_PROMPTS[3]]
    params = [others[0], seeded, others[1], others[2], seeded, others[3]]
    batched = llm.generate(prompts, params)
    assert batched[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert batched[4].outputs[0].token_ids == alone.outputs[0].token_ids
    assert batched[0].outputs[0].token_ids != alone.outputs[0].token_ids

    queued = make_llm(setup, drafter, max_num_seqs=2).generate(prompts[2:] + prompts[:2], params[2:] + params[:2])
    assert queued[2].outputs[0].token_ids == alone.outputs[0].token_ids  # admitted when a slot frees
    assert queued[5].outputs[0].token_ids == alone.outputs[0].token_ids
