"""The logits processors (processors.py) under speculation: each verify position processed as
the target alone would process it after that position's context, against transformers'
processors (repetition penalty, sequence bias, min new tokens, prefix-constrained tokens) and
OpenAI's formula for the presence and frequency penalties; greedy output equal to transformers' generate with the same
processors, for a chain, a tree and prompt lookup; sampled output following the exact processed
distribution (chi-square)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from test_distribution import (
    VOCAB,
    assert_follows,
    exact_distributions,
    setup,  # noqa: F401  (the fixture: a tiny target over 32 tokens, a draft, a prompt)
)
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from helpers import load_hf, save_tree_models
from specdec import LLM, SamplingParams
from specdec.sequence import Sequence
from specdec.spec.processors import LogitsProcessors
from specdec.tree import ROOT, branches

EOS = 1
# bad words for the position tests, as a stub tokenizer encodes them (alone, after a space)
BAD_WORD_IDS = {("ab",): [[7], [8, 9]], ("cd", "e"): [[10, 11, 12], [13], [14, 15]]}


class StubTokenizer:
    """Encodes the words of BAD_WORD_IDS: "ab" as [7] alone and [8, 9] after a space, ..."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        table = {"ab": [7], " ab": [8, 9], "cd": [10, 11, 12], " cd": [13], "e": [14, 15], " e": [14, 15]}
        return table[text]


def reference(
    z: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams, eos=(EOS,)
) -> torch.Tensor:
    """One position's processed logits [V] after prompt + output (drafts included), from
    transformers' processors and OpenAI's formula, in processors.py's order."""
    ids = torch.tensor([prompt + output])  # [1, L]
    scores = z[None].clone()  # [1, V]
    if params.allowed_token_ids is not None:
        allowed = list(params.allowed_token_ids)
        scores = PrefixConstrainedLogitsProcessor(lambda batch_id, ids: allowed, num_beams=1)(ids, scores)
    if params.bad_words:
        words = BAD_WORD_IDS[params.bad_words]
        # vLLM's: a word's beginning is looked for in the output alone, not the prompt
        scores = NoBadWordsLogitsProcessor(words)(torch.tensor([output], dtype=torch.long).reshape(1, -1), scores)
    if params.logit_bias:
        bias = [[[token], float(value)] for token, value in params.logit_bias.items()]
        scores = SequenceBiasLogitsProcessor(bias)(ids, scores)
    if params.min_tokens:
        held = sorted(set(() if params.ignore_eos else eos) | set(params.stop_token_ids))
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, held)(ids, scores)
    if params.repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=z.shape[-1]).float()
    # OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
    return scores[0] - counts * params.frequency_penalty - (counts > 0).float() * params.presence_penalty


def random_params(rng: random.Random, V: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=40,
        presence_penalty=rng.choice([0.0, 0.7, -1.2]),
        frequency_penalty=rng.choice([0.0, 0.4, 1.9]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        logit_bias=rng.choice([None, {rng.randrange(V): rng.uniform(-100, 100) for _ in range(3)}]),
        min_tokens=rng.choice([0, 3, 9]),
        stop_token_ids=rng.choice([(), (rng.randrange(V),)]),
        ignore_eos=rng.random() < 0.3,
        allowed_token_ids=rng.choice([None, rng.sample(range(V), 12)]),
        bad_words=rng.choice([(), *BAD_WORD_IDS]),
    )


def random_tree_parents(rng: random.Random, D: int) -> list[int]:
    return [ROOT] + [rng.choice([ROOT] + list(range(i))) for i in range(1, D)]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_each_position_is_processed_as_after_its_own_context(shape):
    """Random rows (prompt, output, params) and drafts; position t of a row follows the output
    and the drafts on its branch (a chain's first t; a tree node's ancestors and itself)."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    V, B, D = 50, 6, 5
    batch, drafts, parents = [], [], []
    for row in range(B):
        params = random_params(rng, V)
        seq = Sequence(str(row), [rng.randrange(V) for _ in range(rng.randint(1, 8))], params, gen)
        seq.output_token_ids.extend(rng.randrange(V) for _ in range(rng.randint(1, 6)))
        seq.output_token_ids.extend(rng.choice([[], [10], [10, 11], [8]]))  # bad words' beginnings
        batch.append(seq)
        drafts.append([rng.choice([rng.randrange(V), 8, 10, 11]) for _ in range(D)])
        parents.append(list(range(-1, D - 1)) if shape == "chain" else random_tree_parents(rng, D))
    parents_t = torch.tensor(parents)  # [B, D]
    parents_t[:, 0] = ROOT
    visible = branches(parents_t)  # [B, D+1, D+1]: column t sees column s (0: the last token)
    on_branch = visible[:, :, 1:]  # [B, D+1, D]
    logits = torch.randn(B, D + 1, V, generator=gen) * 3  # [B, T, V]
    processed = LogitsProcessors((EOS,), StubTokenizer())(logits, batch, torch.tensor(drafts), on_branch)  # type: ignore[arg-type]
    for row, seq in enumerate(batch):
        for t in range(D + 1):
            context = [drafts[row][s] for s in range(D) if on_branch[row, t, s]]
            want = reference(logits[row, t], seq.prompt_token_ids, seq.output_token_ids + context, seq.params)
            torch.testing.assert_close(processed[row, t], want, rtol=1e-6, atol=1e-5)


def test_rows_without_processors_are_returned_as_they_came():
    gen = torch.Generator().manual_seed(0)
    seq = Sequence("0", [3, 4], SamplingParams(), gen)
    seq.output_token_ids.append(5)
    logits = torch.randn(1, 2, 9, generator=gen)
    assert LogitsProcessors((EOS,))(logits, [seq], torch.tensor([[1]]), torch.ones(1, 2, 1, dtype=torch.bool)) is logits


# --- greedy, end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a draft that is the target plus noise (helpers.save_tree_models)."""
    return save_tree_models(tmp_path_factory.mktemp("processors"))


def hf_greedy(model, prompt: list[int], params: SamplingParams, eos: int) -> list[int]:
    """transformers' greedy generate with the same processors (no presence or frequency penalty:
    it has none)."""
    allowed = list(params.allowed_token_ids) if params.allowed_token_ids is not None else None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=params.max_tokens,
        min_new_tokens=params.min_tokens,
        repetition_penalty=params.repetition_penalty,
        sequence_bias=[[[t], float(b)] for t, b in (params.logit_bias or {}).items()] or None,
        eos_token_id=eos,
        pad_token_id=eos,
        prefix_allowed_tokens_fn=(lambda batch_id, ids: allowed) if allowed is not None else None,
    )
    return out[0, len(prompt) :].tolist()


DRAFTERS = {
    "chain": dict(speculative_method="draft_model", num_speculative_tokens=4),
    "tree": dict(speculative_method="draft_model", num_speculative_tokens=6, speculative_tree="2,2,1"),
    "lookup": dict(speculative_model="[ngram]", num_speculative_tokens=4),
    "staged": dict(speculative_method="staged", num_speculative_tokens=4),  # prompt lookup, then the draft model
}


def drafter_kwargs(pair, drafter: str) -> dict:
    kwargs = dict(DRAFTERS[drafter])
    if drafter == "staged":
        kwargs["speculative_model"] = ["[ngram]", str(pair["draft"])]
    elif kwargs.get("speculative_model") is None:
        kwargs["speculative_model"] = str(pair["draft"])
    return kwargs


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_equals_transformers_generate_with_the_same_processors(pair, drafter):
    """repetition_penalty, logit_bias (EOS pushed up, another token down) and min_tokens (which
    holds the EOS back for a while): the tokens transformers' generate gives, EOS included."""
    model = load_hf(pair["target"])
    llm = LLM(str(pair["target"]), dtype="float32", speculative_k_policy="fixed", **drafter_kwargs(pair, drafter))
    (eos,) = llm.target.eos_token_ids
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 300) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    prompts[0] = prompts[0] * 3  # repeats: prompt lookup finds drafts
    settings = [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.4),
        SamplingParams(temperature=0, max_tokens=30, logit_bias={eos: 6.0, 100: -100}, min_tokens=7),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=0.7, logit_bias={50: 2.5}),
        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=list(range(100, 140)), ignore_eos=True),
    ]
    stopped_by_eos = accepted = 0
    for params in settings:
        outputs = llm.generate(prompts, params)
        accepted += sum(o.metrics.num_accepted_tokens for o in outputs)
        for prompt, output in zip(prompts, outputs):
            want = hf_greedy(model, prompt, params, eos)
            assert output.outputs[0].token_ids == want, (params, prompt)
            stopped_by_eos += want[-1] == eos
            assert len(want) >= params.min_tokens
    assert stopped_by_eos >= 2  # min_tokens held the EOS back until its time, then let it through
    assert accepted > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_staged_drafts_come_from_the_processed_stage(pair, monkeypatch, temperature):
    """Staged drafts' inner verify processes the draft model's logits as the target's are: under
    allowed_token_ids every token the staged drafter proposes is an allowed one (the draft
    model's own corrections and bonus tokens come from its processed distribution; unprocessed,
    most would fall outside the 12 allowed of 320), and the greedy output is transformers'."""
    from specdec.spec.staged import StagedDrafter

    proposed: list[int] = []
    propose = StagedDrafter.propose

    def recording(self, batch, ks, sampling):
        draft = propose(self, batch, ks, sampling)
        for row, n in enumerate(draft.num_tokens.tolist()):
            proposed.extend(draft.token_ids[row, :n].tolist())
        return draft

    monkeypatch.setattr(StagedDrafter, "propose", recording)
    llm = LLM(str(pair["target"]), dtype="float32", speculative_k_policy="fixed", **drafter_kwargs(pair, "staged"))
    allowed = list(range(200, 212))
    params = SamplingParams(temperature=temperature, max_tokens=24, allowed_token_ids=allowed, ignore_eos=True, seed=3)
    prompts = [[200, 201, 202, 203, 200, 201, 202, 203, 200, 201], [5, 6, 7, 8, 9]]
    outputs = llm.generate(prompts, params)
    assert len(proposed) > 20 and set(proposed) <= set(allowed), sorted(set(proposed) - set(allowed))[:10]
    if temperature == 0:
        model = load_hf(pair["target"])
        (eos,) = llm.target.eos_token_ids
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, params, eos) for p in prompts]


@pytest.mark.parametrize("drafter", ["chain", "tree"])
def test_greedy_with_bad_words_equals_transformers_generate(pair, drafter):
    """Words the target alone would write (each a stretch of its own greedy output's text): with
    them as bad_words, none of their encodings is completed, and the tokens are those of
    transformers' generate with the same token sequences banned (in the output)."""
    model = load_hf(pair["target"])
    llm = LLM(
        str(pair["target"]),
        speculative_model=str(pair["draft"]),
        dtype="float32",
        speculative_k_policy="fixed",
        **DRAFTERS[drafter],
    )
    tokenizer = llm.engine.output.tokenizer
    prompt = [40, 41, 42, 43, 44]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    words = (tokenizer.decode(plain.token_ids[2:4]), tokenizer.decode(plain.token_ids[9:10]))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=words)
    banned = llm.engine.round.processors._bad_words_ids(words)
    assert banned
    got = llm.generate([prompt], params)[0].outputs[0].token_ids
    want = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=20,
        bad_words_ids=banned,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert got == want
    assert got != plain.token_ids
    for ids in banned:
        assert not any(got[i : i + len(ids)] == ids for i in range(len(got))), ids


def test_bad_words_are_encoded_alone_and_after_a_space(pair):
    llm = LLM(str(pair["target"]), dtype="float32", speculative_method="none")
    tokenizer = llm.engine.output.tokenizer
    words = ("return", " self", "def")
    encodings = [
        tokenizer.encode(text, add_special_tokens=False) for w in words for text in (w.lstrip(), " " + w.lstrip())
    ]
    want = [ids for i, ids in enumerate(encodings) if ids not in encodings[:i]]
    assert llm.engine.round.processors._bad_words_ids(words) == want
    with pytest.raises(ValueError, match="bad_words"):
        LLM(str(pair["target"]), skip_tokenizer_init=True).generate([[5, 6]], SamplingParams(bad_words=["x"]))


def test_greedy_with_presence_and_frequency_penalties_equals_a_step_by_step_reference(pair):
    """The target's logits one token at a time (transformers' model), OpenAI's formula, argmax:
    the same tokens as the engine's with a draft model."""
    model = load_hf(pair["target"])
    llm = LLM(str(pair["target"]), speculative_model=str(pair["draft"]), dtype="float32", num_speculative_tokens=4)
    prompt = [7, 8, 9, 7, 8, 9, 10]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.9, frequency_penalty=1.6)
    output: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            z = model(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference(z, prompt, output, params).argmax()))
    got = llm.generate([prompt], params)[0]
    assert got.outputs[0].token_ids == output
    assert len(set(output)) > 8  # the penalties spread it over many tokens


# --- sampled: chi-square ---------------------------------------------------------------------

NUM_DRAWS = 30_000
PROCESSED = dict(
    temperature=0.9, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.5, logit_bias={3: 2.0, 4: -100}
)


def processed_continuation_logits(models: dict, params: SamplingParams) -> np.ndarray:
    """The setup fixture's continuation logits [V^(T-1), T, V], each position processed after its context
    (the prompt, then the continuation's tokens before it) by the reference."""
    logits = torch.from_numpy(models["logits"])
    count, T, V = logits.shape
    continuations = list(itertools.product(range(V), repeat=T - 1))
    out = torch.empty_like(logits)
    for i, continuation in enumerate(continuations):
        for t in range(T):
            out[i, t] = reference(logits[i, t], models["prompt"], list(continuation[:t]), params, eos=())
    return out.numpy()


# each drafter's own options, and how many draws its run gets (the draft model's chain, the
# first, gets the most; the others check their own paths: a head's scored tokens, prompt
# lookup's point masses, a tree's siblings judged one after another)
SAMPLED_DRAFTERS = {
    "draft_model": (dict(num_speculative_tokens=2), NUM_DRAWS),
    "eagle": (dict(speculative_method="eagle", num_speculative_tokens=2), NUM_DRAWS // 2),
    "ngram": (dict(speculative_model="[ngram]", num_speculative_tokens=2), NUM_DRAWS // 2),
    "tree": (dict(speculative_tree="3,2", num_speculative_tokens=5), NUM_DRAWS // 2),
    # prompt lookup, then the draft model verifying it with processed logits (spec/staged.py)
    "staged": (dict(speculative_method="staged", num_speculative_tokens=2), NUM_DRAWS // 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("drafter", sorted(SAMPLED_DRAFTERS))
def test_sampled_tokens_follow_the_processed_target(setup, drafter):  # noqa: F811  (the imported fixture)
    """All four processors at once, each drafter: the three tokens follow their exact processed
    marginals and joint, drafts accepted and rejected."""
    options, draws = SAMPLED_DRAFTERS[drafter]
    params = SamplingParams(max_tokens=3, ignore_eos=True, **PROCESSED)
    setting = dict(temperature=PROCESSED["temperature"])
    joints = exact_distributions(processed_continuation_logits(setup, params), setting)
    model = {"eagle": setup["head"], "ngram": "[ngram]", "staged": ["[ngram]", setup["draft"]]}.get(
        drafter, setup["draft"]
    )
    llm = LLM(
        setup["target"],
        **{"speculative_model": model, **options},
        dtype="float32",
        skip_tokenizer_init=True,
        speculative_k_policy="fixed",
        max_num_seqs=draws,
        seed=77,
    )
    outputs = llm.generate([setup["prompt"]] * draws, params)
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, 3]
    accepted = sum(out.metrics.num_accepted_tokens for out in outputs)
    proposed = sum(out.metrics.num_draft_tokens for out in outputs)
    assert draws // 100 < accepted < proposed - draws // 100, (accepted, proposed)
    assert not (tokens == 4).any()  # biased by -100
    T, V = 3, VOCAB
    for t in range(T):
        marginal = joints[-1].sum(axis=tuple(i for i in range(T) if i != t))
        assert_follows(tokens[:, t], marginal, f"processed, {drafter}: token {t + 1}")
    assert_follows(np.ravel_multi_index(tokens.T, (V,) * T), joints[-1], f"processed, {drafter}: joint")
