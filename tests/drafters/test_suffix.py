"""Suffix decoding (drafters/suffix.py): the drafts arctic-inference's trees give, against what
the token streams fed to them say; greedy output equal to the target alone in float32 with
trees from earlier requests' outputs; a seeded request that owes nothing to other requests; the
shared tree bounded; and the settings refused by name. The sampled distribution's chi-square
test is in tests/spec/test_distribution.py, with every drafter's."""

from __future__ import annotations

import pytest
import torch

from helpers import random_prompts, save_tiny_model, token_ids
from specdec import LLM, SamplingParams
from specdec.config import SamplingParams as Params
from specdec.config import SpeculativeConfig
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.sampling import SamplingTensors
from specdec.sequence import Sequence
from specdec.spec import k_choice
from specdec.spec.goodput import GoodputPolicy, padded_width
from specdec.tree import ROOT

arctic = pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference is not installed: make setup")

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def sequence(
    request_id: str, prompt: list[int], output: list[int], seed: int | None = None, temperature=0.0, scope=None
):
    params = Params(temperature=temperature, seed=seed, max_tokens=64)
    return Sequence(request_id, prompt, params, torch.Generator(), cache_scope=scope)


def finished(drafter: SuffixDrafter, request_id: str, prompt: list[int], output: list[int], scope=None) -> None:
    """A request served to its end: its output goes into its scope's shared tree."""
    seq = sequence(request_id, prompt, [], scope=scope)
    drafter.propose([seq], [0], SamplingTensors.from_params([seq.params], "cpu"))
    seq.output_token_ids = list(output)
    seq.finish_reason = "length"
    drafter.release(seq)


def propose(drafter: SuffixDrafter, seqs: list[Sequence], ks: list[int]):
    return drafter.propose(seqs, ks, SamplingTensors.from_params([s.params for s in seqs], "cpu"))


def test_earlier_outputs_that_part_ways_draft_a_tree():
    """Two earlier answers continue [5, 6, 7] with 8 9 and with 1 2: a request ending in 5 6 7
    drafts both branches as one tree (parents before children), at most k nodes, no deeper than
    the match allows (max_spec_factor x match length)."""
    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=10, max_spec_factor=2.0, min_token_prob=0.1)
    finished(drafter, "a", [100], [5, 6, 7, 8, 9, 10])
    finished(drafter, "b", [101], [5, 6, 7, 1, 2, 3])
    seq = sequence("c", [50, 5, 6, 7], [])
    draft = propose(drafter, [seq], [4])
    assert draft.parents is not None and int(draft.num_tokens[0]) == 4
    tokens, parents = draft.token_ids[0].tolist(), draft.parents[0].tolist()
    assert all(p < i for i, p in enumerate(parents))
    firsts = {tokens[i] for i, p in enumerate(parents) if p == ROOT}
    assert firsts == {8, 1}
    for child, parent in ((9, 8), (2, 1)):
        assert parents[tokens.index(child)] == tokens.index(parent)
    assert int(propose(drafter, [seq], [20]).num_tokens[0]) <= 2 * 3 * 2  # a 3-token match: 6 a branch, two branches


def test_a_trees_nodes_are_ranked_by_how_often_their_paths_followed_the_match():
    """Three earlier answers continue [5, 6, 7]: twice with 8 9 10, once with 1 2 3. A node's
    score is the log of its path's share of the continuations (8, 8 9 and 8 9 10: 2/3; 1: 1/3),
    which the round's cut ranks nodes by (spec/tree_width.py)."""
    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=10, max_spec_factor=2.0, min_token_prob=0.1)
    for name, output in (("a", [5, 6, 7, 8, 9, 10]), ("b", [5, 6, 7, 8, 9, 10]), ("c", [5, 6, 7, 1, 2, 3])):
        finished(drafter, name, [100 + len(name)], output)
    draft = propose(drafter, [sequence("d", [50, 5, 6, 7], [])], [4])
    assert draft.parents is not None and draft.scores is not None
    n = int(draft.num_tokens[0])
    by_path = {}
    for i, (token, parent) in enumerate(zip(draft.token_ids[0, :n].tolist(), draft.parents[0, :n].tolist())):
        by_path[i] = (by_path[parent][0] if parent != ROOT else ()) + (token,), float(draft.scores[0, i].exp())
    shares = dict(by_path.values())
    assert shares == pytest.approx({(8,): 2 / 3, (8, 9): 2 / 3, (8, 9, 10): 2 / 3, (1,): 1 / 3})


def test_a_single_path_is_a_chain_and_no_match_is_nothing():
    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=10, max_spec_factor=4.0)
    finished(drafter, "a", [100], [5, 6, 7, 8, 9, 10])
    seqs = [sequence("c", [50, 5, 6], []), sequence("d", [51, 52], [])]
    draft = propose(drafter, seqs, [3, 3])
    assert draft.parents is None  # one path: verified as a chain
    assert draft.token_ids[0].tolist() == [7, 8, 9] and draft.num_tokens.tolist() == [3, 0]


def test_a_request_drafts_from_its_own_text_as_it_grows():
    """Its prompt and each output token as it comes: the repeat of its own text is drafted, with
    nothing in the shared tree."""
    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=0, max_spec_factor=2.0)
    seq = sequence("a", [3, 4, 5, 6, 7, 3, 4], [])
    assert propose(drafter, [seq], [3]).token_ids[0].tolist() == [5, 6, 7]
    seq.output_token_ids = [5, 6, 7, 9, 3, 4]  # a new continuation, 9, after 5 6 7 once
    draft = propose(drafter, [seq], [4])
    assert set(draft.token_ids[0, : int(draft.num_tokens[0])].tolist()) >= {5, 6, 7}


def test_a_seeded_sampled_row_drafts_from_its_own_text_alone():
    """What others were answered drafts for greedy and unseeded rows, never for a seeded sampled
    one: its random draws would depend on the server's history."""
    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=10, max_spec_factor=2.0)
    finished(drafter, "a", [100], [5, 6, 7, 8, 9, 10])
    greedy = sequence("g", [50, 5, 6, 7], [])
    unseeded = sequence("u", [51, 5, 6, 7], [], temperature=1.0)
    seeded = sequence("s", [52, 5, 6, 7], [], seed=3, temperature=1.0)
    draft = propose(drafter, [greedy, unseeded, seeded], [2, 2, 2])
    assert draft.num_tokens.tolist() == [2, 2, 0]


def test_the_shared_tree_holds_the_newest_requests_and_a_preempted_one_once():
    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=2, max_spec_factor=2.0)
    for i, output in enumerate(([5, 6, 7, 8], [20, 21, 22, 23], [30, 31, 32, 33])):
        finished(drafter, f"r{i}", [100 + i], output)
    assert len(drafter.shared(None).cached_requests) == 2  # running requests count too, as they add their outputs
    assert propose(drafter, [sequence("y", [1, 30, 31], [])], [2]).token_ids[0].tolist() == [32, 33]
    assert propose(drafter, [sequence("x", [1, 5, 6], [])], [2]).num_tokens.tolist() == [0]  # the oldest: dropped
    preempted = sequence("p", [9, 9], [])
    propose(drafter, [preempted], [0])
    preempted.output_token_ids = [40, 41, 42]
    drafter.release(preempted)  # not finished: recomputed later, its output dropped meanwhile
    assert propose(drafter, [sequence("z", [1, 40, 41], [])], [1]).num_tokens.tolist() == [0]
    assert not drafter.started.keys() - {"x", "y", "z"}


def test_a_request_drafts_from_its_own_scopes_answers_alone():
    """Cache scopes (a server's API keys): an answer to one scope's request drafts for that
    scope's later requests, never for another scope's or the global scope's."""
    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=10, max_spec_factor=2.0)
    finished(drafter, "a", [100], [5, 6, 7, 8, 9], scope="key0")
    finished(drafter, "b", [101], [20, 21, 22, 23], scope="key1")
    asks = [sequence(name, [1, 5, 6], [], scope=scope) for name, scope in (("x", "key0"), ("y", "key1"), ("z", None))]
    draft = propose(drafter, asks, [3, 3, 3])
    assert draft.token_ids[0].tolist() == [7, 8, 9] and draft.num_tokens.tolist() == [3, 0, 0]
    assert propose(drafter, [sequence("w", [1, 21, 22], [], scope="key1")], [1]).token_ids[0].tolist() == [23]


def test_forget_drops_every_tree():
    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=10, max_spec_factor=2.0)
    finished(drafter, "a", [100], [5, 6, 7, 8])
    drafter.forget()
    assert propose(drafter, [sequence("b", [1, 5, 6], [])], [2]).num_tokens.tolist() == [0]


def test_settings_are_checked_by_name():
    for bad, words in (
        (dict(suffix_decoding_max_tree_depth=0), "suffix_decoding_max_tree_depth must be an integer from 1"),
        (dict(suffix_decoding_max_cached_requests=-1), "suffix_decoding_max_cached_requests must be an integer from 0"),
        (dict(suffix_decoding_max_spec_factor=0.0), "suffix_decoding_max_spec_factor must be a number > 0"),
        (dict(suffix_decoding_min_token_prob=1.5), r"suffix_decoding_min_token_prob must be in \[0, 1\]"),
    ):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig(method="suffix", **bad)
    with pytest.raises(ValueError, match="configure suffix decoding, which speculative_method='ngram' does not use"):
        SpeculativeConfig(method="ngram", suffix_decoding_max_tree_depth=8)
    with pytest.raises(ValueError, match="shaped by that text, not by speculative_tree: drop it"):
        SpeculativeConfig(method="suffix", tree="auto")


# --- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("suffix") / "target", "llama", seed=3, init_std=0.3)


def test_greedy_with_suffix_drafts_equals_the_target_alone(target, monkeypatch):
    """Requests one after another, then all again batched (every answer now in the shared
    tree: most of each is drafted and accepted), then with a queue for slots: each equal to the
    target alone in float32; some rounds verified trees."""
    trees = []
    original = SuffixDrafter.propose

    def recording(self, batch, ks, sampling):
        draft = original(self, batch, ks, sampling)
        trees.append(draft.is_tree)
        return draft

    monkeypatch.setattr(SuffixDrafter, "propose", recording)
    prompts = random_prompts(6, seed=21, lengths=(3, 12)) + random_prompts(2, seed=22, repeat=True)
    expected = token_ids(LLM(str(target), dtype="float32", speculative_method="none").generate(prompts, GREEDY))
    llm = LLM(  # k fixed: goodput's k follows timings, and this test counts what was accepted
        str(target),
        dtype="float32",
        speculative_method="suffix",
        num_speculative_tokens=8,
        speculative_k_policy="fixed",
    )
    one_by_one = [llm.generate([prompt], GREEDY)[0] for prompt in prompts]
    assert token_ids(one_by_one) == expected
    again = llm.generate(prompts, GREEDY)
    assert token_ids(again) == expected
    accepted = sum(o.metrics.num_accepted_tokens for o in again)
    assert accepted > 0.6 * sum(len(t) for t in expected), "the shared tree held every answer: most should be drafted"
    queued = LLM(str(target), dtype="float32", speculative_method="suffix", max_num_seqs=3)
    assert token_ids(queued.generate(prompts + prompts, GREEDY)) == expected + expected
    assert any(trees), "no round drafted a tree: the test's outputs never parted ways"


# --- suffix decoding, then a draft model or head ----------------------------------------------


def test_drafted_rows_join_a_suffix_tree_as_chains_of_point_masses():
    """lookup_then_draft's merge where the free draft is a tree: the drafter's rows become chains
    (each node's parent the node before), widths padded, and no distributions (point masses)."""
    from specdec.drafters.base import Draft
    from specdec.drafters.lookup_then_draft import _merge

    looked_up = Draft(
        torch.tensor([[8, 1, 9], [0, 0, 0]]), torch.tensor([3, 0]), None, torch.tensor([[ROOT, ROOT, 0], [ROOT] * 3])
    )
    drafted = Draft(torch.tensor([[4, 5, 6, 7]]), torch.tensor([4]), torch.rand(1, 4, 10).softmax(-1))
    merged = _merge(looked_up, drafted, torch.tensor([1]))
    assert merged.probs is None and merged.num_tokens.tolist() == [3, 4]
    assert merged.token_ids.tolist() == [[8, 1, 9, 0], [4, 5, 6, 7]]
    assert merged.parents is not None and merged.parents.tolist() == [[ROOT, ROOT, 0, ROOT], [ROOT, 0, 1, 2]]


class NamedDrafter(Drafter):
    """A drafter behind suffix decoding that proposes nothing and notes the rows it was asked for."""

    def __init__(self):
        self.drafted: list[list[str]] = []  # each call's request ids

    def propose(self, batch, ks, sampling):
        self.drafted.append([seq.request_id for seq in batch])
        return Draft.empty(len(batch), "cpu")


def test_the_outlook_offers_each_row_its_drafters_and_propose_follows_the_pick():
    """Suffix decoding, free, where a tree continues the row's context (with as many nodes as it
    would give at that k), or the drafter behind it; the drafter alone elsewhere. The one the row
    would take by itself comes first (for a sampled row whose suffix drafts were accepted less
    often than the drafter's, the drafter). propose drafts each row as assign said."""
    from specdec.drafters.base import RowOutlook
    from specdec.drafters.lookup_then_draft import DRAFTER, LOOKUP
    from specdec.drafters.suffix_then_draft import SuffixThenDraftDrafter

    suffix = SuffixDrafter(max_tree_depth=16, max_cached_requests=10, max_spec_factor=1.0)
    drafter = SuffixThenDraftDrafter(suffix, NamedDrafter())
    finished(suffix, "a", [100], [5, 6, 7, 8, 9, 10])
    seqs = [
        sequence("c", [50, 5, 6], []),  # a 2-token match: 2 tokens at max_spec_factor 1
        sequence("d", [51, 52], []),  # no match
        sequence("e", [53, 5, 6, 7], [], temperature=0.8),  # sampled: 3 matched, 3 to give
    ]
    assert drafter.outlook(seqs, 8) == [
        (RowOutlook(LOOKUP, free=True, most=2), RowOutlook(DRAFTER)),
        (RowOutlook(DRAFTER),),
        (RowOutlook(LOOKUP, free=True, most=3), RowOutlook(DRAFTER)),
    ]
    assert drafter.outlook(seqs, 1)[0][0] == RowOutlook(LOOKUP, free=True, most=1)
    drafter._rates(seqs[2])[LOOKUP].observe(8, 0)  # its suffix drafts rejected at once, twice
    drafter._rates(seqs[2])[LOOKUP].observe(8, 0)
    assert drafter.outlook(seqs, 8)[2] == (RowOutlook(DRAFTER), RowOutlook(LOOKUP, free=True, most=3))

    drafted = drafter.drafter.drafted
    drafter.assign(seqs, [RowOutlook(DRAFTER), RowOutlook(DRAFTER), RowOutlook(LOOKUP, free=True, most=3)])
    draft = propose(drafter, seqs, [2, 3, 3])
    assert drafted == [["c", "d"]] and draft.num_tokens.tolist() == [0, 0, 3]  # the pick, not its own choice
    drafted.clear()
    draft = propose(drafter, seqs, [2, 3, 3])  # no pick for this round: the row's own choice
    assert drafted == [["d", "e"]] and draft.token_ids[0, :2].tolist() == [7, 8]


@pytest.fixture(scope="module")
def draft(tmp_path_factory, target):
    """The target plus noise: it agrees with the target often, not always."""
    from helpers import load_hf

    model = load_hf(target)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.1 * param.std().clamp(min=0.1))
    path = tmp_path_factory.mktemp("suffix_draft") / "draft"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((target / name).read_bytes())
    return path


STEP_SECONDS = 1e-3  # simulated: a target forward of one token a row
DRAFT_STEP_SECONDS = STEP_SECONDS / 10  # simulated: a draft step, as a small draft model's


def simulated_verify_seconds(num_tokens: float) -> float:
    """A target forward of num_tokens tokens a row: a step, and a tenth of one per token past the first."""
    return STEP_SECONDS * (1 + 0.1 * (num_tokens - 1))


class SimulatedGoodputPolicy(GoodputPolicy):
    """The goodput policy on a simulated machine: calibration's clock advances by the simulated
    seconds of each forward it runs (the forwards still run), and each round is told its
    simulated seconds, not what it took. The draft model here is the target's size, so on real
    timings drafting barely pays and a loaded machine can switch it off for a whole test; on
    these, which rounds draft rests on acceptance alone."""

    def __init__(self, k_max: int, cost_width=padded_width):
        self.now = 0.0
        super().__init__(k_max, cost_width, clock=lambda: self.now)

    def calibrate(self, batch_size: int, k: int, time_target, time_draft) -> None:
        def target_forward(num_tokens: int) -> None:
            time_target(num_tokens)
            self.now += simulated_verify_seconds(num_tokens)

        def draft_step() -> None:
            time_draft()
            self.now += DRAFT_STEP_SECONDS

        super().calibrate(batch_size, k, target_forward, draft_step)

    def observe_round(
        self,
        batch_size: int,
        k: int,
        verify_tokens: int,
        target_seconds: float,
        draft_seconds: float | None,
        num_verified: int | None = None,
    ) -> None:
        num_verified = batch_size * verify_tokens if num_verified is None else num_verified
        target_seconds = simulated_verify_seconds(self.cost_width(batch_size, num_verified, verify_tokens))
        draft_seconds = None if draft_seconds is None else k * DRAFT_STEP_SECONDS  # None: not every row drafted
        super().observe_round(batch_size, k, verify_tokens, target_seconds, draft_seconds, num_verified)


@pytest.mark.parametrize("k_policy", ["fixed", "goodput"])
def test_greedy_suffix_then_draft_equals_the_target_alone(target, draft, monkeypatch, k_policy):
    """Suffix decoding where it matches, the draft model elsewhere, in the same rounds: equal to
    the target alone in float32, one by one and batched; both drafted. Under goodput each
    drafter's acceptance is estimated apart (the outlook says who drafts each row), its costs
    simulated (SimulatedGoodputPolicy): that the draft model drafts must not hang on timings."""
    from specdec.drafters.suffix_then_draft import SuffixThenDraftDrafter

    monkeypatch.setattr(k_choice, "GoodputPolicy", SimulatedGoodputPolicy)
    sources = []
    original = SuffixThenDraftDrafter._with_drafter

    def recording(self, batch, ks, sampling, looked_up, unmatched):
        sources.append((len(unmatched), len(batch) - len(unmatched)))
        return original(self, batch, ks, sampling, looked_up, unmatched)

    monkeypatch.setattr(SuffixThenDraftDrafter, "_with_drafter", recording)
    prompts = random_prompts(6, seed=23, lengths=(3, 12))
    expected = token_ids(LLM(str(target), dtype="float32", speculative_method="none").generate(prompts, GREEDY))
    llm = LLM(
        str(target),
        dtype="float32",
        speculative_model=str(draft),
        speculative_method="suffix_then_draft",
        num_speculative_tokens=6,
        speculative_k_policy=k_policy,
    )
    assert token_ids([llm.generate([prompt], GREEDY)[0] for prompt in prompts]) == expected
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert any(drafted for drafted, _ in sources) and any(suffixed for _, suffixed in sources)
    if k_policy == "goodput":
        from specdec.drafters.lookup_then_draft import DRAFTER, LOOKUP

        assert isinstance(llm.engine.policy, SimulatedGoodputPolicy)  # else real timings decided
        priors = llm.engine.policy.priors
        assert priors[LOOKUP].judged > 0 and priors[DRAFTER].judged > 0  # both drafted, each learnt apart
