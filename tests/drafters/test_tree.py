"""Tree drafts (speculative_tree): the shapes; one tree forward gives every node the logits
its branch gets alone (checked against transformers); tree verification follows the target
exactly (greedy: the target's own tokens; sampled: exact first- and second-token
distributions of a fixed tree, by chi-square); and through LLM, greedy output with a tree of
any shape, for every drafter that grows trees, is the target's own, with accepted branches
moved into place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import load_hf, random_prompts, save_tree_models, token_ids
from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.kv_cache import KVCache, TreeAttention
from specdec.models.loader import load_pretrained
from specdec.spec.verify import greedy_tree_verify, tree_rejection_sample
from specdec.tools.benchmark.chi_square import chi_square_p_value
from specdec.tree import ROOT, TreeShape, branches, depths

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# --- shapes and structure ----------------------------------------------------------------


def test_tree_shapes_parse_and_bad_ones_are_refused():
    assert TreeShape.parse("chain").is_chain
    assert TreeShape.parse("auto").kind == "auto"
    assert TreeShape.parse("3, 2,1").branching == (3, 2, 1)
    assert str(TreeShape.parse("3,2,1")) == "3,2,1"
    for bad in ("", "3,,1", "0,2", "a", "3;2", "tree", 3):
        with pytest.raises(ValueError, match="speculative_tree"):
            TreeShape.parse(bad)
    with pytest.raises(ValueError, match="grows trees"):
        SpeculativeConfig(method="ngram", tree="auto")


def test_branches_and_depths_of_a_small_tree():
    # root -> 0 -> 2 -> 4; root -> 1 -> 3
    parents = torch.tensor([[ROOT, ROOT, 0, 1, 2]])
    visible = branches(parents)[0].int().tolist()
    assert visible[5] == [1, 1, 0, 1, 0, 1]  # node 4: root, 0, 2, itself
    assert visible[4] == [1, 0, 1, 0, 1, 0]  # node 3: root, 1, itself
    assert depths(parents).tolist() == [[0, 1, 1, 2, 2, 3]]


# --- the tree forward --------------------------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny target, a noisy copy of it as the draft, an untrained head (helpers.save_tree_models)."""
    return save_tree_models(tmp_path_factory.mktemp("tree"))


def test_a_tree_forward_gives_each_node_what_its_branch_gives_alone(dirs):
    """A prompt in the cache, then one forward over [last token, tree nodes] with the tree
    layout: each node's logits equal transformers' logits after prompt + its branch, in rows
    of different prompt lengths."""
    model = load_pretrained(dirs["target"], "float32", load_tokenizer=False).model
    reference = load_hf(dirs["target"])
    parents = torch.tensor([[ROOT, ROOT, 0, 0, 1, 2, ROOT], [ROOT, 0, 1, 2, ROOT, 4, 4]])  # [B, N]
    B, N = parents.shape
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (length,), generator=g) for length in (9, 5)]
    nodes = torch.randint(0, 320, (B, N), generator=g)
    cache = KVCache(2, B, 32, model.config.num_kv_heads, model.config.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        for row, prompt in enumerate(prompts):  # all of the prompt but its last token
            model(prompt[None, :-1], torch.arange(len(prompt) - 1)[None], cache.rows([row]))
        first = torch.tensor([len(p) - 1 for p in prompts])  # [B]: the last token's position
        input_ids = torch.cat([torch.stack([p[-1] for p in prompts])[:, None], nodes], dim=1)  # [B, N+1]
        tree = TreeAttention(first[:, None] + torch.arange(N + 1), first, branches(parents))
        logits = model(input_ids, first[:, None] + depths(parents), cache, tree=tree)  # [B, N+1, V]
        for row, prompt in enumerate(prompts):
            for column in range(N + 1):
                branch = branches(parents)[row, column].nonzero().squeeze(1)  # its columns, root first
                sequence = torch.cat([prompt[:-1], input_ids[row, branch]])
                expected = reference(sequence[None]).logits[0, -1]
                torch.testing.assert_close(logits[row, column], expected, atol=2e-4, rtol=1e-4)


# --- verification ------------------------------------------------------------------------

# root's children: tokens 3, 1, 4; node 0's (token 3) children: tokens 2, 0
TREE_TOKENS = torch.tensor([[3, 1, 4, 2, 0]])
TREE_PARENTS = torch.tensor([[ROOT, ROOT, ROOT, 0, 0]])


def test_greedy_tree_verify_takes_the_matching_child_at_every_depth():
    argmax = torch.tensor([[1, 9, 0, 9, 9, 9]])  # root wants 1 (node 1, column 2), which has no children
    output, num_accepted, path = greedy_tree_verify(TREE_TOKENS, TREE_PARENTS, torch.tensor([5]), argmax)
    assert output.tolist() == [[1, 0, -1, -1, -1, -1]] and num_accepted.tolist() == [1]
    assert path[0, :2].tolist() == [0, 2]
    argmax = torch.tensor([[3, 0, 9, 9, 9, 9]])  # root wants 3 (node 0), node 0 wants 0 (node 4)
    output, num_accepted, path = greedy_tree_verify(TREE_TOKENS, TREE_PARENTS, torch.tensor([5]), argmax)
    assert output[0, :3].tolist() == [3, 0, 9] and num_accepted.tolist() == [2]
    assert path[0, :3].tolist() == [0, 1, 5]
    # nodes past num_nodes do not exist
    output, num_accepted, _ = greedy_tree_verify(TREE_TOKENS, TREE_PARENTS, torch.tensor([4]), argmax)
    assert output[0, :2].tolist() == [3, 0] and num_accepted.tolist() == [1]


def test_tree_rejection_sampling_follows_the_target_at_the_first_and_second_token():
    """A fixed tree over 6 tokens and fixed target distributions at every column: over many
    rows, the first emitted token follows p at the root, and the second, given a first token
    that is a node with children (3), follows p at that node; rows that take a second child
    (1, 4) exist, and so do rows that take no child."""
    V, draws = 6, 60_000
    g = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(1, 6, V, generator=g) * 1.5, dim=-1)  # [1, N+1, V]
    B = draws
    generators = [torch.Generator().manual_seed(1)] * B  # rows share one stream, drawn in row order
    output, num_accepted, path = tree_rejection_sample(
        TREE_TOKENS.expand(B, -1),
        TREE_PARENTS.expand(B, -1),
        torch.full((B,), 5),
        target_probs.expand(B, -1, -1),
        generators,
    )
    first = output[:, 0].numpy()
    p_value = chi_square_p_value(first, target_probs[0, 0], "first token")
    assert p_value > 1e-3, p_value
    after_3 = output[output[:, 0] == 3][:, 1].numpy()  # p at node 0 (column 1)
    p_value = chi_square_p_value(after_3, target_probs[0, 1], "second token after 3")
    assert p_value > 1e-3, p_value
    assert ((first == 1) & (num_accepted.numpy() == 1)).sum() > 1000  # a second sibling accepted
    assert (num_accepted.numpy() == 0).sum() > 1000
    taken = path[:, 1].numpy()
    assert set(np.unique(taken[num_accepted.numpy() > 0])) == {1, 2, 3}


def test_a_seeded_row_draws_the_same_whatever_its_neighbours():
    V = 6
    g = torch.Generator().manual_seed(3)
    target_probs = torch.softmax(torch.randn(3, 6, V, generator=g), dim=-1)
    seeded = lambda: torch.Generator().manual_seed(42)  # noqa: E731
    alone = tree_rejection_sample(TREE_TOKENS, TREE_PARENTS, torch.tensor([5]), target_probs[:1], [seeded()])
    shared = torch.Generator().manual_seed(7)
    batch = tree_rejection_sample(
        TREE_TOKENS.expand(3, -1),
        TREE_PARENTS.expand(3, -1),
        torch.tensor([5, 2, 5]),
        target_probs[[0, 1, 2]],
        [seeded(), shared, shared],
    )
    assert batch[0][0].tolist() == alone[0][0].tolist() and batch[1][0] == alone[1][0]


# --- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected(dirs):
    prompts = random_prompts(4, seed=11)
    return prompts, token_ids(
        LLM(str(dirs["target"]), dtype="float32", speculative_method="none").generate(prompts, GREEDY)
    )


@pytest.mark.parametrize("method", ["draft_model", "eagle", "early_exit"])
def test_greedy_with_a_tree_equals_the_target_alone(dirs, expected, method, monkeypatch):
    """Every shape, ragged batches and queued rows; for the draft model, some accepted branches
    were not where a chain would lie (their K/V entries were moved into place)."""
    moved = []
    original = KVCache.move

    def recording(self, slots, sources, destinations):
        moved.append(bool((sources != destinations).any()))
        return original(self, slots, sources, destinations)

    monkeypatch.setattr(KVCache, "move", recording)
    prompts, target_tokens = expected
    model = {"draft_model": dirs["draft"], "eagle": dirs["head"], "early_exit": None}[method]
    for shape, k in (("auto", 6), ("3,2,1", 8), ("1,1,1,1", 4), ("2,2", 3)):
        kwargs = dict(
            speculative_model=None if model is None else str(model),
            speculative_method=method,
            num_speculative_tokens=k,
            dtype="float32",
            speculative_tree=shape,
            speculative_k_policy="fixed",  # every node verified (goodput's cut: test_tree_width.py)
        )
        llm = LLM(str(dirs["target"]), **kwargs)
        assert token_ids(llm.generate(prompts[:1], GREEDY)) == target_tokens[:1], f"{shape} batch 1"
        outputs = llm.generate(prompts, GREEDY)
        assert token_ids(outputs) == target_tokens, f"{shape} ragged batch"
        assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
        queued = LLM(str(dirs["target"]), max_num_seqs=2, **kwargs).generate(prompts, GREEDY)
        assert token_ids(queued) == target_tokens, f"{shape} queued"
    if method == "draft_model":
        assert any(moved), "every accepted branch was already in place: the test's draft is too good"


def test_a_tree_for_a_drafter_of_chains_is_refused(dirs):
    with pytest.raises(ValueError, match="grows trees"):
        LLM(str(dirs["target"]), speculative_method="ngram", speculative_tree="auto")
