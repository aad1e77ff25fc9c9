"""Which rows of a ragged forward (a prefill, a draft's catch-up) run together, where the
model's attention cannot take flat rows (PyTorch's, on CUDA; elsewhere the runner runs the real
tokens alone, kv_cache.FlatRows, and needs no groups).

A forward over rows of different lengths runs as one padded batch [B, W]: every row as long as
the longest, and the linear layers, nearly all of a long forward's time, multiply the padding
too. Prompts of 26 to 329 tokens in one batch of 16 make 5,264 rows for 2,694 real tokens.
Splitting the batch into forwards of similar lengths saves the padding, but each forward has a
cost of its own, whatever its rows (the weights read once more, the layers' launches).

Terms:
  padded tokens  a group's rows x its longest row: what its forward multiplies
  split cost     a forward's own cost, counted in padded tokens: what splitting must save to pay

ragged_groups chooses the partition that minimises the sum over groups of (padded tokens +
split cost). Sorted by length, some optimal partition takes consecutive rows (a shorter row
never gains by joining a group of longer rows over one of shorter), so a dynamic programme over
the sorted distinct lengths finds it in O(D^2), D distinct lengths.
"""

from __future__ import annotations

import itertools
from collections import Counter

# A forward's own cost in padded tokens. Measured: Qwen2.5-Coder-1.5B (Q4_K_M) on one core of
# this project's CPUs prefills ~60 tokens/s, and a forward's fixed part (its weights read once)
# is ~70 ms, i.e. ~5 tokens; a 22M model's fixed part (Python and launches over its layers)
# is worth far more of its cheap tokens. 128 keeps small models from splitting for little and
# still takes most of what a real model saves (docs/runner.md, "Ragged prefills").
SPLIT_COST_TOKENS = 128


def ragged_groups(lengths: list[int], split_cost: int = SPLIT_COST_TOKENS) -> list[list[int]]:
    """The rows (indices into lengths) in groups that each run as one forward, the shortest rows'
    group first: the cheapest partition by the module's rule; one group of every row, in order,
    when splitting does not pay. Rows of equal length always share a group (moving one into its
    twin's group never costs more), so the programme runs over the distinct lengths: a sampling
    test's batch of thousands of rows of a few lengths costs no more to group than a few rows."""
    if split_cost < 0:
        raise ValueError(f"split_cost must be >= 0, got {split_cost}")
    rows_of_length = Counter(lengths)
    distinct = sorted(rows_of_length)  # shortest first
    rows_up_to = list(itertools.accumulate((rows_of_length[n] for n in distinct), initial=0))  # [D + 1]
    # cheapest[end]: the least cost of the rows of the first `end` distinct lengths; first[end]:
    # the first distinct length of its last group
    cheapest = [0] + [float("inf")] * len(distinct)
    first = [0] * (len(distinct) + 1)
    for end in range(1, len(distinct) + 1):
        for start in range(end):
            cost = cheapest[start] + (rows_up_to[end] - rows_up_to[start]) * distinct[end - 1] + split_cost
            if cost < cheapest[end]:
                cheapest[end], first[end] = cost, start
    bounds, end = [], len(distinct)
    while end > 0:
        bounds.append((distinct[first[end]], distinct[end - 1]))
        end = first[end]
    if len(bounds) <= 1:
        return [list(range(len(lengths)))]
    return [[row for row, n in enumerate(lengths) if low <= n <= high] for low, high in reversed(bounds)]
