"""A draft model with another tokenizer than the target's (drafters/cross_tokenizer.py): the
output is the target's (greedy token for token, sampled by chi-square), the draft's cache stays
in step with the text, and the junction rule gives what re-tokenizing the whole text gives.

The greedy tests need a draft that agrees with the target often, through two different
tokenizations: two tiny models trained for a few seconds on the same little Python text, each
with its own byte-level BPE (of different vocabulary sizes) trained on that text. Prompts are
fresh random slices of it.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import TEXT, hf_config, load_hf, make_tokenizer, token_ids
from spec.test_distribution import VOCAB, assert_follows, continuation_logits, exact_distributions
from specdec import LLM, SamplingParams
from specdec.drafters import CrossTokenizerDrafter, DraftModelDrafter
from specdec.drafters.cross_tokenizer import JUNCTION_TOKENS, target_proposal
from specdec.models.loader import ModelLoadError
from specdec.models.tokenizer import Tokenizer
from specdec.sequence import Sequence
from specdec.spec.staged import StagedDrafter

TARGET_VOCAB, DRAFT_VOCAB = 320, 270  # asked of the tokenizer trainer (the target's gets 313 from TEXT)
TRAIN_STEPS = 150


def train_on_text(path: Path, tokenizer, text: str, seed: int, **config) -> Path:
    """A tiny llama (hf_config's, with config's changes) trained TRAIN_STEPS steps on text in
    the tokenizer's tokens, saved with the tokenizer."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(tokenizer.encode(text).ids)
    vocab_size = max(tokenizer.get_vocab().values()) + 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config("llama", vocab_size, **config), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(TRAIN_STEPS):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=g).tolist()
        batch = torch.stack([ids[start : start + 64] for start in starts])  # [8, 64]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    save_tokenizer(path, tokenizer)
    return path


def save_tokenizer(path: Path, tokenizer) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross-tokenizer")
    target_tokenizer, draft_tokenizer = make_tokenizer(TARGET_VOCAB), make_tokenizer(DRAFT_VOCAB)
    assert target_tokenizer.get_vocab() != draft_tokenizer.get_vocab()
    return {
        "target": train_on_text(root / "target", target_tokenizer, TEXT, seed=1, num_hidden_layers=2),
        "draft": train_on_text(root / "draft", draft_tokenizer, TEXT, seed=2, num_hidden_layers=1),
    }


@pytest.fixture(scope="module")
def middle(pair, tmp_path_factory) -> Path:
    """A one-layer model of the target's own tokenizer, trained on the same text: the stage that a
    draft with another tokenizer drafts for in staged drafts (other tokenizer -> it -> target)."""
    root = tmp_path_factory.mktemp("cross-tokenizer-middle")
    tokenizer = make_tokenizer(TARGET_VOCAB)
    return train_on_text(root / "middle", tokenizer, TEXT, seed=3, num_hidden_layers=1)


@pytest.fixture(scope="module")
def llm(pair) -> LLM:
    return LLM(
        str(pair["target"]),
        speculative_model=str(pair["draft"]),
        dtype="float32",
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
    )


def text_prompts(n: int, seed: int) -> list[str]:
    """n fresh random slices of TEXT, 5 to 60 characters long."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        start = rng.randrange(len(TEXT) - 60)
        prompts.append(TEXT[start : start + rng.randrange(5, 60)])
    return prompts


# --- the output is the target's ----------------------------------------------------------------


def test_the_draft_model_method_picks_it_for_another_tokenizer(llm):
    assert isinstance(llm.engine.drafter, CrossTokenizerDrafter)


@pytest.mark.parametrize("k, batch_size, seed", [(1, 1, 11), (3, 6, 12), (5, 6, 13)])
def test_greedy_output_is_the_targets(llm, k, batch_size, seed):
    """Greedy, float32: token for token what the target alone generates, alone and in batches
    whose rows accept different numbers of drafts."""
    prompts = text_prompts(batch_size, seed)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    speculative = llm.with_drafter(llm.engine.drafter, k, "fixed").generate(prompts, params)
    plain = llm.target_only().generate(prompts, params)
    assert token_ids(speculative) == token_ids(plain)
    accepted = [out.metrics.num_accepted_tokens for out in speculative]
    proposed = [out.metrics.num_draft_tokens for out in speculative]
    assert sum(accepted) > sum(proposed) // 4, f"{accepted} of {proposed} accepted: the draft hardly agrees"
    if batch_size > 1:
        assert len(set(accepted)) > 1, f"every row accepted {accepted[0]}"


def test_no_row_proposes_more_than_its_k(llm, monkeypatch):
    """Rows given different ks propose at most their own k target tokens each."""
    drafter = llm.engine.drafter
    seen = []
    propose = drafter.propose

    def recording(batch, ks, sampling):
        draft = propose(batch, ks, sampling)
        seen.extend(zip(ks, draft.num_tokens.tolist()))
        return draft

    monkeypatch.setattr(drafter, "propose", recording)
    llm.with_drafter(drafter, 5, "goodput").generate(
        text_prompts(4, 21), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    assert seen and all(n <= k for k, n in seen)
    assert any(n > 0 for _, n in seen)


def test_the_drafts_cache_stays_in_step_with_the_text(llm, monkeypatch):
    """Through a batched greedy run (each round feeds a row's cache only what its re-encoded
    text does not share with what it was fed): the draft's logits after every catch-up equal
    those of a fresh cache fed the same draft context whole."""
    drafter = llm.engine.drafter
    seen = []
    catch_up = drafter._catch_up

    def recording(slots, contexts):
        logits = catch_up(slots, contexts)
        seen.extend(zip(contexts, logits))
        return logits

    monkeypatch.setattr(drafter, "_catch_up", recording)
    llm.with_drafter(drafter, 4, "fixed").generate(
        text_prompts(3, 31), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    monkeypatch.undo()
    assert len(seen) > 3 * 5
    fresh = drafter.sharing_weights()
    for context, logits in seen:
        fresh.reserve(1, 256)  # forgets every slot
        fresh.blocks.grow(0, len(context) + 1)  # the blocks propose holds for a row
        torch.testing.assert_close(fresh._catch_up([0], [context])[0], logits, rtol=1e-4, atol=1e-4)


def six_at_once(pair) -> LLM:
    """The pair's target drafted for by its other-tokenizer draft, k = 4 fixed, six requests at once."""
    return LLM(
        str(pair["target"]),
        speculative_model=str(pair["draft"]),
        dtype="float32",
        num_speculative_tokens=4,
        speculative_k_policy="fixed",
        max_num_seqs=6,
    )


def test_a_small_pool_preempts_and_the_drafts_pool_keeps_no_block(pair):
    """Served in a budget of 12 blocks for six requests: the engine preempts, the draft's own
    pool (twice the engine's blocks: DRAFT_LENGTH_FACTOR) hands rows blocks as their contexts
    grow (a row it cannot grow proposes nothing), and every greedy output is still the target
    alone's; once all finish, neither pool holds a block."""
    llm = six_at_once(pair)
    plain = llm.target_only()
    prompts = text_prompts(6, 71)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, params)]
    llm.engine.prepare_to_serve(max_model_len=128, kv_cache_bytes=12 * llm.engine.capacity.position_bytes * 16)
    engine_blocks = llm.engine.capacity.blocks
    drafter = llm.engine.drafter
    assert isinstance(drafter, CrossTokenizerDrafter) and drafter.blocks is not None
    assert drafter.blocks.num_blocks == 1 + (engine_blocks.num_blocks - 1) * 2
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(str(i), llm.prompt_token_ids(prompt, params), params)
    got: dict[str, list[int]] = {}
    with torch.inference_mode():
        while llm.engine.has_unfinished_requests():
            for output in llm.engine.step():
                got.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    assert [got[str(i)] for i in range(6)] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert engine_blocks.num_held == 0 and drafter.blocks.num_held == 0


def test_preempted_requests_give_the_tokens_they_give_unpreempted(pair):
    """Six requests, half greedy and half sampled with seeds of their own, in a budget of 12
    blocks (preempting: swapped out, the draft's own blocks and state kept) give the tokens they
    give in a budget that holds them all."""
    llm = six_at_once(pair)
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True, **(dict(temperature=0) if i % 2 else dict(seed=i)))
        for i in range(6)
    ]
    prompts = [llm.prompt_token_ids(prompt, p) for prompt, p in zip(text_prompts(6, 72), params)]
    engine = llm.engine
    runs = []
    for kv_cache_bytes in (None, 12 * engine.capacity.position_bytes * 16):
        engine.prepare_to_serve(max_model_len=128, kv_cache_bytes=kv_cache_bytes)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, p)
        got: dict[str, list[int]] = {}
        with torch.inference_mode():
            while engine.has_unfinished_requests():
                for output in engine.step():
                    got.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
        runs.append((got, engine.scheduler.num_preemptions, engine.preemption.swap.num_swapped_out))
    (unpreempted, none, _), (preempted, preemptions, swapped) = runs
    assert none == 0 and preemptions > 0 and swapped == preemptions
    assert preempted == unpreempted


# --- as the first stage of staged drafts ---------------------------------------------------------


@pytest.mark.parametrize("k, batch_size, seed", [(2, 1, 41), (4, 6, 42)])
def test_as_the_first_stage_greedy_output_is_the_targets(pair, middle, k, batch_size, seed):
    """Staged drafts other tokenizer -> middle -> target (SmolLM2-135M -> 0.5B -> 1.5B in small):
    the draft drafts through text for the middle stage, whose tokens the target verifies; greedy,
    float32, the output is the target alone's, and both levels accepted some drafts and rejected
    others."""
    llm = LLM(
        str(pair["target"]),
        speculative_model=[str(pair["draft"]), str(middle)],
        dtype="float32",
        num_speculative_tokens=k,
        speculative_k_policy="fixed",
    )
    drafter = llm.engine.drafter
    assert isinstance(drafter, StagedDrafter) and isinstance(drafter.inner, CrossTokenizerDrafter)
    prompts = text_prompts(batch_size, seed)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert token_ids(outputs) == token_ids(llm.target_only().generate(prompts, params))
    accepted = sum(out.metrics.num_accepted_tokens for out in outputs)
    judged = sum(out.metrics.num_judged_tokens for out in outputs)
    assert 0 < accepted < judged, f"the target accepted {accepted} of {judged} judged drafts"
    inner = drafter.stats
    assert 0 < inner.num_accepted_tokens < inner.num_judged_tokens, inner.summary()


@pytest.mark.parametrize("stages", [("[ngram]", "draft"), ("middle", "draft")])
def test_another_tokenizer_after_the_first_stage_is_refused_with_what_to_do(pair, middle, stages):
    """A stage that others draft for drafts in its own tokens, so only the first may have another
    tokenizer: a later one is refused, naming it and what to do."""
    models = {"draft": str(pair["draft"]), "middle": str(middle), "[ngram]": "[ngram]"}
    message = r"stage 2 \(.*draft\) has another tokenizer than the target.*put it first"
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(pair["target"]), speculative_model=[models[name] for name in stages], dtype="float32")


# --- loading ------------------------------------------------------------------------------------


def test_a_draft_of_the_targets_own_tokenizer_stays_a_draft_model(tiny_pair):
    llm = LLM(str(tiny_pair["target"]), speculative_model=str(tiny_pair["draft"]), dtype="float32")
    assert isinstance(llm.engine.drafter, DraftModelDrafter)


def test_without_tokenizers_another_vocabulary_is_refused_with_what_to_do(pair):
    with pytest.raises(ModelLoadError, match="vocab_size 270.*skip_tokenizer_init"):
        LLM(str(pair["target"]), speculative_model=str(pair["draft"]), skip_tokenizer_init=True)


def test_a_draft_without_its_tokenizer_is_refused_with_what_to_do(pair, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    for name in ("config.json", "model.safetensors"):
        (draft / name).write_bytes((pair["draft"] / name).read_bytes())
    with pytest.raises(ModelLoadError, match="tokenizer.json is missing"):
        LLM(str(pair["target"]), speculative_model=str(draft))


def test_lookup_then_draft_names_the_method_that_takes_another_tokenizer(pair):
    with pytest.raises(ModelLoadError, match="'draft_model' drafts through text"):
        LLM(str(pair["target"]), speculative_model=str(pair["draft"]), speculative_method="lookup_then_draft")


# --- the junction -------------------------------------------------------------------------------


def stdlib_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((stdlib / name).read_text() for name in ("abc.py", "copy.py", "string.py", "types.py"))


def reference_proposal(tokenizer: Tokenizer, text: str, draft_text: str, settled_text: str, k: int) -> list[int]:
    """From the whole text: where the tokens of text + draft_text begin with text's own, the
    tokens after them whose text is a prefix of settled_text (at most k); else none."""
    own = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.encode(text + draft_text, add_special_tokens=False)
    if whole[: len(own)] != own:
        return []
    kept: list[int] = []
    for token in whole[len(own) : len(own) + k]:
        read = tokenizer.decode(own + kept + [token], skip_special_tokens=False)
        if not (read.startswith(text) and settled_text.startswith(read[len(text) :])):
            break
        kept.append(token)
    return kept


@pytest.mark.parametrize("vocab_size", [300, 2000])
def test_the_junction_is_what_the_whole_text_tokenizes_to(vocab_size):
    """Over random cut points of Python source: a sequence (the target's tokens of a text), a
    draft text after it and a settled prefix of that: the proposal from the window alone equals
    the one from re-tokenizing the whole text, both when the junction holds (proposals) and when
    the draft text would merge into the sequence's last token (none)."""
    text = stdlib_text()
    tokenizer = Tokenizer(make_tokenizer(vocab_size, text[:30_000]))
    rng = random.Random(vocab_size)
    outcomes = {"proposed": 0, "none": 0}
    for _ in range(600):
        start = rng.randrange(len(text) - 300)
        cut = start + rng.randrange(1, 200)
        end = cut + rng.randrange(1, 40)
        sequence_text, draft_text = text[start:cut], text[cut:end]
        settled_text = draft_text[: rng.randrange(len(draft_text) + 1)]
        k = rng.randrange(1, 8)
        sequence = tokenizer.encode(sequence_text, add_special_tokens=False)
        expected = reference_proposal(tokenizer, sequence_text, draft_text, settled_text, k)
        got = target_proposal(tokenizer, sequence, draft_text, settled_text, k)
        assert got == expected, (sequence_text[-30:], draft_text, settled_text, k)
        outcomes["proposed" if got else "none"] += 1
    assert min(outcomes.values()) > 100, outcomes


def test_a_junction_inside_a_word_waits_for_the_settled_text():
    """ " ret" then "urn x": the target's " return" is proposed only once the settled text holds
    the whole word; a sequence ending in a token the draft text merges into proposes nothing."""
    tokenizer = Tokenizer(make_tokenizer(400, "def f(x):\n    return x\n" * 50))
    sequence = tokenizer.encode("def f(x):\n   ", add_special_tokens=False)
    (return_id,) = tokenizer.encode(" return", add_special_tokens=False)
    assert target_proposal(tokenizer, sequence, " return x", " ret", 4) == []
    assert target_proposal(tokenizer, sequence, " return x", " return", 4) == [return_id]
    assert target_proposal(tokenizer, sequence, " return x", " return x", 1) == [return_id]
    split = sequence + tokenizer.encode(" re", add_special_tokens=False)  # " re" + "turn": one token " return"
    assert len(split) <= len(sequence) + JUNCTION_TOKENS
    assert target_proposal(tokenizer, split, "turn x", "turn x", 4) == []


def test_the_drafts_end_of_sequence_becomes_the_targets():
    """A special token both tokenizers have crosses as itself: "</s>" in the draft text is the
    target's "</s>" token."""
    tokenizer = Tokenizer(make_tokenizer(320))
    sequence = tokenizer.encode("def add(a, b):\n    return", add_special_tokens=False)
    proposal = target_proposal(tokenizer, sequence, " a + b</s>", " a + b</s>", 8)
    assert proposal[-1] == tokenizer.token_to_id("</s>")
    assert tokenizer.decode(proposal, skip_special_tokens=False) == " a + b</s>"


def test_a_special_token_the_draft_lacks_reaches_it_as_text(pair):
    """The target text keeps the target's special tokens as text: one the draft's tokenizer
    has ("</s>") is its token, one it lacks is read as characters."""
    llm = LLM(str(pair["target"]), speculative_model=str(pair["draft"]), dtype="float32")
    drafter = llm.engine.drafter
    assert isinstance(drafter, CrossTokenizerDrafter)
    drafter.reserve(1, 64)
    drafter.target_tokenizer.backend.add_special_tokens(["<|fim|>"])
    target_ids = drafter.target_tokenizer.encode("x = 1</s><|fim|>y", add_special_tokens=False)
    row = drafter._read(Sequence("special", target_ids, SamplingParams(), torch.Generator()), 2)
    assert row is not None
    draft = drafter.draft_tokenizer
    assert row.context[: len(drafter.draft_prefix)] == drafter.draft_prefix == [draft.token_to_id("<s>")]
    read = draft.decode(row.context[len(drafter.draft_prefix) :], skip_special_tokens=False)
    assert read == "x = 1</s><|fim|>y"
    assert draft.token_to_id("</s>") in row.context
    assert draft.token_to_id("<|fim|>") is None


# --- sampled output follows the target ------------------------------------------------------


NUM_DRAWS = 40_000  # enough for the chi-square tests below; more only slows the suite
CHI_ALPHABET = "ab \n"


def ab_text(seed: int) -> str:
    """Random text over four characters (a, b, space, newline)."""
    rng = random.Random(seed)
    return "".join(rng.choice(["a", "b", "ab", "ba", " ", "\n", " ab", "aab"]) for _ in range(5000))


def small_tokenizer(vocab_size: int, text: str):
    """A byte-level BPE of vocab_size tokens trained on text of ab_text's four characters:
    small enough for the exact distribution over every continuation."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator([text], trainer)
    assert tokenizer.get_vocab_size() == vocab_size
    return tokenizer


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A target over VOCAB (32) tokens and a draft over 20 of another tokenizer, each trained a
    little on random text of four characters (so that the draft's argmax is often likely under
    the target, and often not), and a prompt: the target's tokens of a short such text."""
    root = tmp_path_factory.mktemp("cross-tokenizer-chi")
    text = ab_text(seed=0)
    dims = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    target_tokenizer = small_tokenizer(VOCAB, ab_text(seed=1))
    return {
        "target": train_on_text(root / "target", target_tokenizer, text, seed=7, num_hidden_layers=1, **dims),
        "draft": train_on_text(
            root / "draft", small_tokenizer(20, ab_text(seed=2)), text, seed=9, num_hidden_layers=1, **dims
        ),
        "prompt": target_tokenizer.encode("ab ba\naab b").ids,
        "middle": train_on_text(root / "middle", target_tokenizer, text, seed=11, num_hidden_layers=1, **dims),
    }


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05)])
def test_sampled_tokens_follow_the_target(small_pair, setting):
    """max_tokens 4 over 40,000 copies of one prompt: after the prefill's token, one round
    verifies up to two carried-over target tokens (point masses), then a recovered or bonus
    token. Each token follows its exact marginal and the first three their exact joint; drafts
    were accepted and rejected, second ones judged too."""
    T, V = 4, VOCAB
    llm = LLM(
        str(small_pair["target"]),
        speculative_model=str(small_pair["draft"]),
        dtype="float32",
        num_speculative_tokens=2,
        speculative_k_policy="fixed",
        max_num_seqs=NUM_DRAWS,
        seed=5,
    )
    assert isinstance(llm.engine.drafter, CrossTokenizerDrafter)
    prompt = small_pair["prompt"]
    joints = exact_distributions(continuation_logits(load_hf(small_pair["target"]), prompt, T), setting)
    params = SamplingParams(max_tokens=T, ignore_eos=True, **setting)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_DRAWS, params)
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, 4]
    assert tokens.shape == (NUM_DRAWS, T)

    proposed = sum(out.metrics.num_draft_tokens for out in outputs)
    accepted = sum(out.metrics.num_accepted_tokens for out in outputs)
    second_judged = sum(
        out.metrics.accepted_by_position[:1] == [1] for out in outputs if out.metrics.num_draft_tokens > 1
    )
    assert proposed >= NUM_DRAWS // 4, f"only {proposed} draft tokens were verified"
    assert 1000 < accepted < proposed - 1000, f"{accepted} of {proposed} drafts accepted: one path untested"
    assert second_judged > 1000, f"only {second_judged} second drafts were judged"
    for t in range(T):
        marginal = joints[-1].sum(axis=tuple(i for i in range(T) if i != t))
        assert_follows(tokens[:, t], marginal, f"cross-tokenizer {setting}: token {t + 1}")
    assert_follows(np.ravel_multi_index(tokens[:, :3].T, (V,) * 3), joints[2], f"cross-tokenizer {setting}: joint")


@pytest.mark.slow
def test_as_the_first_stage_sampled_tokens_follow_the_target(small_pair):
    """Staged drafts other tokenizer -> middle (the target's tokenizer) -> target, sampled at
    temperature 1, k 3 (so the middle stage draws two tokens for the target, the draft's first
    point mass judged by it): over 40,000 copies of one prompt, each of four tokens follows its
    exact marginal and the first three their exact joint; both levels accepted and rejected."""
    T, V = 4, VOCAB
    setting = dict(temperature=1.0)
    llm = LLM(
        str(small_pair["target"]),
        speculative_model=[str(small_pair["draft"]), str(small_pair["middle"])],
        dtype="float32",
        num_speculative_tokens=3,
        speculative_k_policy="fixed",
        max_num_seqs=NUM_DRAWS,
        seed=6,
    )
    drafter = llm.engine.drafter
    assert isinstance(drafter, StagedDrafter) and isinstance(drafter.inner, CrossTokenizerDrafter)
    prompt = small_pair["prompt"]
    joints = exact_distributions(continuation_logits(load_hf(small_pair["target"]), prompt, T), setting)
    params = SamplingParams(max_tokens=T, ignore_eos=True, **setting)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_DRAWS, params)
    tokens = np.array([out.outputs[0].token_ids for out in outputs])  # [N, 4]
    accepted = sum(out.metrics.num_accepted_tokens for out in outputs)
    judged = sum(out.metrics.num_judged_tokens for out in outputs)
    assert 1000 < accepted < judged - 1000, f"the target accepted {accepted} of {judged} judged drafts"
    inner = drafter.stats
    assert 1000 < inner.num_accepted_tokens < inner.num_judged_tokens - 1000, inner.summary()
    for t in range(T):
        marginal = joints[-1].sum(axis=tuple(i for i in range(T) if i != t))
        assert_follows(tokens[:, t], marginal, f"staged other tokenizer -> middle: token {t + 1}")
    assert_follows(np.ravel_multi_index(tokens[:, :3].T, (V,) * 3), joints[2], "staged other tokenizer: joint")
