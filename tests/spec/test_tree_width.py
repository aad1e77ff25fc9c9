"""A grown tree cut to the width its verify buys (spec/tree_width.py, tree.likeliest_nodes):
the cut against a brute-force ranking, the choice of width against the formula evaluated for
every width, the calibration against a known acceptance rate, and end to end: greedy output
still the target's alone, with the cut made narrow or kept whole by the verify's costs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from helpers import random_prompts, save_tree_models, token_ids
from specdec import LLM, SamplingParams
from specdec.drafters.base import Draft
from specdec.spec import tree_width
from specdec.spec.goodput import CostCurve, GoodputPolicy, RoundCosts
from specdec.spec.tree_width import TreeWidth
from specdec.tree import ROOT, likeliest_nodes

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def random_ranked_tree(rng: random.Random, N: int, num_nodes: int) -> tuple[list[int], list[float]]:
    """A tree of num_nodes nodes (padded to N), parents before children, each node's score its
    parent's plus a log-probability (some exactly 0: ties with the parent)."""
    parents, scores = [], []
    for node in range(num_nodes):
        parent = rng.choice([ROOT] + list(range(node)))
        step = 0.0 if rng.random() < 0.15 else math.log(rng.uniform(0.05, 1.0))
        parents.append(parent)
        scores.append((0.0 if parent == ROOT else scores[parent]) + step)
    pad = N - num_nodes
    return parents + [ROOT] * pad, scores + [float("-inf")] * pad


def brute_force_likeliest(parents: list[int], scores: list[float], num_nodes: int, n: int):
    """The n best scores, ties to the smaller number; kept in ascending order, parents renumbered."""
    ranked = sorted(range(num_nodes), key=lambda node: (-scores[node], node))[:n]
    kept = sorted(ranked)
    new = {old: i for i, old in enumerate(kept)}
    return kept, [ROOT if parents[old] == ROOT else new[parents[old]] for old in kept]


def test_the_likeliest_nodes_are_the_brute_force_ranking_and_closed_under_parents():
    rng = random.Random(4)
    for _ in range(60):
        B, N = rng.randint(1, 4), rng.randint(1, 12)
        rows = [random_ranked_tree(rng, N, rng.randint(0, N)) for _ in range(B)]
        num_nodes = [sum(s > float("-inf") for s in scores) for _, scores in rows]
        n = rng.randint(1, N + 2)
        parents = torch.tensor([p for p, _ in rows])  # [B, N]
        scores = torch.tensor([s for _, s in rows])  # [B, N]
        kept, new_parents, counts = likeliest_nodes(parents, scores, torch.tensor(num_nodes), n)
        for row, ((row_parents, row_scores), count) in enumerate(zip(rows, num_nodes)):
            want_kept, want_parents = brute_force_likeliest(row_parents, row_scores, count, n)
            got = int(counts[row])
            assert got == len(want_kept)
            assert kept[row, :got].tolist() == want_kept
            assert new_parents[row, :got].tolist() == want_parents
            assert all(p == ROOT for p in new_parents[row, got:].tolist())
            assert all(p < i for i, p in enumerate(want_parents))  # parents first, every one kept


def test_a_draft_cut_keeps_its_tokens_and_scores():
    draft = Draft(
        torch.tensor([[5, 6, 7, 8]]),
        torch.tensor([4]),
        parents=torch.tensor([[ROOT, ROOT, 0, 2]]),
        scores=torch.tensor([[-0.1, -2.0, -0.5, -0.6]]),
    )
    cut = draft.likeliest(3)
    assert cut.token_ids.tolist() == [[5, 7, 8]]
    assert cut.parents.tolist() == [[ROOT, 0, 1]]
    assert cut.scores[0].tolist() == pytest.approx([-0.1, -0.5, -0.6])
    assert cut.num_tokens.tolist() == [3]


class FixedCosts:
    """A stand-in for the goodput policy's measured costs: seconds by verify width."""

    def __init__(self, seconds_by_width):
        self.seconds_by_width = seconds_by_width

    def verify_seconds(self, batch_size: int, num_tokens: int) -> float:
        return self.seconds_by_width(num_tokens)


def chain_draft(probs: list[list[float]]) -> Draft:
    """Rows of chains whose nodes' branch probabilities are probs (each row's as long)."""
    B, N = len(probs), len(probs[0])
    parents = torch.tensor([[ROOT] + list(range(N - 1))] * B)
    return Draft(
        torch.zeros(B, N, dtype=torch.long), torch.full((B,), N), parents=parents, scores=torch.tensor(probs).log()
    )


def test_the_width_chosen_is_the_one_of_the_most_expected_tokens_per_second():
    rng = random.Random(7)
    for _ in range(40):
        B, N = rng.randint(1, 3), rng.randint(1, 16)
        probs = [sorted((rng.uniform(0.01, 1.0) for _ in range(N)), reverse=True) for _ in range(B)]
        probs = [[math.prod(row[: i + 1]) for i in range(N)] for row in probs]  # a chain's branch probabilities
        jump = rng.randint(2, 12)
        costs = FixedCosts(lambda width, jump=jump: 1.0 + 0.02 * width + (1.0 if width > jump else 0.0))
        width = TreeWidth(costs)  # type: ignore[arg-type]  # only verify_seconds is read
        goodput = [(B + sum(sum(row[:n]) for row in probs)) / costs.verify_seconds(B, n + 1) for n in range(1, N + 1)]
        assert width.choose(chain_draft(probs)) == max(range(1, N + 1), key=lambda n: (goodput[n - 1], -n))


def test_a_flat_verify_keeps_the_whole_tree_and_a_steep_one_cuts_it():
    probs = [[0.9 ** (i + 1) for i in range(12)]]
    flat = TreeWidth(FixedCosts(lambda width: 1.0))  # type: ignore[arg-type]
    assert flat.choose(chain_draft(probs)) == 12
    steep = TreeWidth(FixedCosts(lambda width: float(width)))  # type: ignore[arg-type]  # a verify of w rows costs w steps
    assert steep.choose(chain_draft(probs)) == 1


def test_the_calibration_learns_how_often_the_target_accepts_what_the_drafter_rates():
    """A drafter sure of its one node (p 0.9) that the target accepts 3 times in 10: c_1 -> 1/3."""
    width = TreeWidth(FixedCosts(lambda w: 1.0))  # type: ignore[arg-type]
    draft = chain_draft([[0.9]] * 10)
    assert width.calibration(1) == 1.0
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        width.observe(draft, torch.ones(10, 1, dtype=torch.long), (torch.rand(10, generator=gen) < 0.3).long())
    assert width.calibration(1) == pytest.approx(0.3 / 0.9, rel=0.1)
    assert width.calibration(2) == 1.0  # never seen


def test_depth_two_is_counted_only_where_depth_one_was_accepted():
    width = TreeWidth(FixedCosts(lambda w: 1.0))  # type: ignore[arg-type]
    draft = Draft(
        torch.zeros(2, 3, dtype=torch.long),
        torch.tensor([3, 3]),
        parents=torch.tensor([[ROOT, ROOT, 0]] * 2),
        scores=torch.tensor([[0.6, 0.3, 0.5]] * 2).log(),
    )
    width.observe(draft, torch.tensor([[1, 1, 2]] * 2), torch.tensor([2, 1]))
    decayed_prior = tree_width.PRIOR_WEIGHT
    assert width.calibration(1) == pytest.approx((2 + decayed_prior) / (2 * 0.9 + decayed_prior))
    assert width.calibration(2) == pytest.approx((1 + decayed_prior) / (2 * 0.5 + decayed_prior))


# --- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny target, a noisy copy of it as the draft, an untrained head (helpers.save_tree_models)."""
    return save_tree_models(tmp_path_factory.mktemp("tree_width"))


def drafts_as_deep_as_it_may(policy: GoodputPolicy) -> None:
    """The policy's own round costs set by hand, not measured: a verify of any width 1 s, a draft
    step 1 ms, so it grows every tree as deep as it may on any machine (what is cut is then up to
    the tree width's verify costs, set by each test)."""
    costs = RoundCosts(CostCurve({1: 1.0, 2: 1.0}), CostCurve({1: 1e-3, 2: 2e-3}))
    policy.costs = {1 << i: costs.copy() for i in range(8)}  # every batch bucket up to 128 rows
    policy.calibrate = lambda *args, **kwargs: None  # type: ignore[method-assign]
    policy.observe_round = lambda *args, **kwargs: None  # type: ignore[method-assign]


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
@pytest.mark.parametrize("verify", ["steep", "flat"])
def test_greedy_with_a_cut_tree_equals_the_target_alone(dirs, method, verify):
    """The verify's costs set by hand: a width w costs w^2 steps (a cut to one node every round:
    one node gives at most one token more, for 4 steps where a plain one is 1) or the same at every
    width (the whole tree every round). Either way the target's own output."""
    prompts = random_prompts(3, seed=12)
    expected = token_ids(LLM(str(dirs["target"]), dtype="float32", speculative_method="none").generate(prompts, GREEDY))
    model = {"draft_model": dirs["draft"], "eagle": dirs["head"]}[method]
    llm = LLM(
        str(dirs["target"]),
        speculative_model=str(model),
        speculative_method=method,
        num_speculative_tokens=6,
        dtype="float32",
        speculative_tree="auto",
    )
    width = llm.engine.k_choice.tree_width
    assert width is not None  # goodput is the default policy
    drafts_as_deep_as_it_may(width.policy)
    seconds = (lambda B, tokens: float(tokens) ** 2) if verify == "steep" else (lambda B, tokens: 1.0)
    width.policy.verify_seconds = seconds  # type: ignore[method-assign]
    grown_and_verified = []
    cut = width.cut

    def recording(draft, batch):
        verified = cut(draft, batch)
        grown_and_verified.append((int(draft.num_tokens.max()), int(verified.num_tokens.max())))
        return verified

    width.cut = recording  # type: ignore[method-assign]
    outputs = llm.generate(prompts, GREEDY)
    assert token_ids(outputs) == expected
    assert grown_and_verified
    if verify == "steep":
        assert {verified for _, verified in grown_and_verified} == {1}
        assert any(grown > 1 for grown, _ in grown_and_verified)
        assert all(o.metrics.num_draft_tokens < o.metrics.num_target_forwards for o in outputs)  # a node a round
    else:
        assert all(grown == verified for grown, verified in grown_and_verified)
        assert any(verified > 1 for _, verified in grown_and_verified)


def test_fixed_verifies_the_whole_tree(dirs):
    llm = LLM(
        str(dirs["target"]),
        speculative_model=str(dirs["draft"]),
        speculative_method="draft_model",
        num_speculative_tokens=6,
        dtype="float32",
        speculative_tree="auto",
        speculative_k_policy="fixed",
    )
    assert llm.engine.k_choice.tree_width is None


def test_suffix_trees_are_cut_by_their_paths_frequencies():
    """Suffix decoding proposes a tree where earlier answers part ways, ranked by how often each
    path followed the match: twice 8 9 10, once 1 2 3. A steep verify keeps 8 alone, a flat one
    the whole tree."""
    pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference is not installed: make setup")
    from specdec.config import SamplingParams as Params
    from specdec.drafters.suffix import SuffixDrafter
    from specdec.sampling import SamplingTensors
    from specdec.sequence import Sequence

    def sequence(request_id: str, prompt: list[int]) -> Sequence:
        return Sequence(request_id, prompt, Params(temperature=0.0, max_tokens=64), torch.Generator())

    drafter = SuffixDrafter(max_tree_depth=16, max_cached_requests=10, max_spec_factor=2.0, min_token_prob=0.1)
    for name, output in (("a", [5, 6, 7, 8, 9, 10]), ("b", [5, 6, 7, 8, 9, 10]), ("c", [5, 6, 7, 1, 2, 3])):
        seq = sequence(name, [100])
        drafter.propose([seq], [0], SamplingTensors.from_params([seq.params], "cpu"))
        seq.output_token_ids, seq.finish_reason = output, "length"
        drafter.release(seq)
    asking = sequence("d", [50, 5, 6, 7])
    draft = drafter.propose([asking], [4], SamplingTensors.from_params([asking.params], "cpu"))
    assert draft.is_tree and int(draft.num_tokens[0]) == 4
    steep = TreeWidth(FixedCosts(lambda w: float(w) ** 2)).cut(draft, [asking])  # type: ignore[arg-type]
    assert steep.token_ids[0, : int(steep.num_tokens[0])].tolist() == [8]
    flat = TreeWidth(FixedCosts(lambda w: 1.0)).cut(draft, [asking])  # type: ignore[arg-type]
    assert flat is draft
