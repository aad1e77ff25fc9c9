"""Rejection sampling: keep a prefix of the draft so the output follows the target exactly.

For one row with n draft tokens x_1..x_n (Leviathan et al. 2023, Chen et al. 2023):
  accepted   x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the
             first rejection;
  recovered  at the first rejection (position j), a token drawn from
             norm(max(0, p_j - q_j)) replaces x_j; if that residual sums to 0, from p_j;
  bonus      if all n are accepted, one more token drawn from p_{n+1}.
So every round emits num_accepted + 1 tokens. Here p = target_probs, q = draft_probs, both
already warped by the request's settings. `draft_probs=None` means a deterministic drafter:
q is a point mass on x_i, so x_i is kept with probability p_i(x_i) and the recovered token is
drawn from p_j with x_j removed. Greedy rows (temperature 0) are prefix matching against the
target's argmax, with no randomness at all.

Numerics: the acceptance test is u * q < p with u a float64 uniform in [0, 1), so u = 0 never
accepts a token of target probability 0, and q = 0 accepts exactly when p > 0.
"""

from __future__ import annotations

import torch

from specdec.sampling import sample_with_uniforms, uniforms


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: list[torch.Generator],
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts.

    draft_token_ids [B, k]      proposed tokens (entries past num_draft are ignored)
    num_draft [B]               how many of the k each row proposed (0..k)
    draft_probs [B, k, V]|None  the distributions the draft tokens were drawn from
    target_probs [B, k+1, V]    the target's warped distributions at each draft position and
                                one past it
    generators                  one per row: each row draws num_draft + 1 uniforms from its
                                own (rows sharing one generator draw from it in row order),
                                so what a row draws depends on that row alone
    greedy [B] bool|None        rows decided by argmax prefix matching

    Returns output_token_ids [B, k+1] (accepted tokens, then the recovered or bonus token,
    padded with -1) and num_accepted [B].
    """
    B, k = draft_token_ids.shape
    device = target_probs.device
    draft_token_ids = draft_token_ids.long()
    num_draft = num_draft.to(device)
    proposed = torch.arange(k, device=device)[None, :] < num_draft[:, None]  # [B, k]
    draws = uniforms(generators, (num_draft + 1).tolist(), device)  # [B, <= k+1]: acceptance tests, final draw
    u = torch.nn.functional.pad(draws, (0, k + 1 - draws.shape[1]))  # [B, k+1]: 0 past a row's draws

    draft_ids = draft_token_ids.clamp(min=0)[..., None]  # [B, k, 1]: padding (even -1) is a valid index
    p_draft_token = target_probs[:, :k].gather(2, draft_ids).squeeze(2).double()  # [B, k]
    q_draft_token = (
        torch.ones_like(p_draft_token) if draft_probs is None else draft_probs.gather(2, draft_ids).squeeze(2).double()
    )  # [B, k]
    accept = (u[:, :k] * q_draft_token < p_draft_token) & proposed  # [B, k]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]: length of the accepted prefix
    u_final = u.gather(1, num_draft[:, None]).squeeze(1)  # [B]: each row's last draw
    final_token = _recovered_or_bonus(num_accepted, num_draft, draft_token_ids, draft_probs, target_probs, u_final)
    output = _assemble(draft_token_ids, num_accepted, final_token)
    if greedy is not None:
        greedy_output, greedy_accepted = greedy_verify(draft_token_ids, num_draft, target_probs.argmax(-1))
        output = torch.where(greedy[:, None], greedy_output, output)
        num_accepted = torch.where(greedy, greedy_accepted, num_accepted)
    return output, num_accepted


def greedy_verify(
    draft_token_ids: torch.Tensor, num_draft: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification, no randomness: drafts are kept while they equal the target's
    argmax, and the token after them is the argmax there. draft_token_ids [B, k],
    num_draft [B], target_argmax [B, k+1] -> (output_token_ids [B, k+1], num_accepted [B])."""
    k = draft_token_ids.shape[1]
    draft_token_ids = draft_token_ids.long()
    proposed = torch.arange(k, device=draft_token_ids.device)[None, :] < num_draft[:, None]  # [B, k]
    accept = (draft_token_ids == target_argmax[:, :k]) & proposed
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    final_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return _assemble(draft_token_ids, num_accepted, final_token), num_accepted


def _assemble(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> torch.Tensor:
    """[accepted drafts..., final token, -1 padding]: [B, k+1]."""
    B, k = draft_token_ids.shape
    positions = torch.arange(k + 1, device=draft_token_ids.device)[None, :]  # [1, k+1]
    padded_draft = torch.cat([draft_token_ids, draft_token_ids.new_full((B, 1), -1)], dim=1)  # [B, k+1]
    output = torch.where(positions < num_accepted[:, None], padded_draft, -1)
    return output.scatter(1, num_accepted[:, None], final_token[:, None])


def _recovered_or_bonus(num_accepted, num_draft, draft_token_ids, draft_probs, target_probs, u_final):
    """The token after the accepted prefix: recovered (from the residual) where a draft was
    rejected, bonus (from p) where all were accepted. Returns [B]."""
    B, k = draft_token_ids.shape
    rows = torch.arange(B, device=target_probs.device)
    p = target_probs[rows, num_accepted]  # [B, V]: p at the first unaccepted position
    rejected = num_accepted < num_draft  # [B]
    j = num_accepted.clamp(max=max(k - 1, 0))  # the rejected position (any valid index for bonus rows)
    if k == 0:
        return sample_with_uniforms(p, u_final)
    if draft_probs is None:
        q = torch.nn.functional.one_hot(draft_token_ids[rows, j].clamp(min=0), p.shape[-1]).to(p.dtype)
    else:
        q = draft_probs[rows, j]  # [B, V]
    residual = (p - q).clamp(min=0)  # [B, V]
    residual_empty = residual.sum(-1, keepdim=True) <= 0  # p <= q everywhere: fall back to p
    residual = torch.where(residual_empty, p, residual)
    return sample_with_uniforms(torch.where(rejected[:, None], residual, p), u_final)


# --- trees ------------------------------------------------------------------------------------
#
# A tree draft (tree.py) offers several candidates after a token: its children. Greedy takes,
# from the root down, the child equal to the target's argmax, as long as there is one. Sampled
# rows take EAGLE's multi-candidate rejection over siblings: the children are a deterministic
# choice (the drafter's likeliest tokens), so each is a point mass: the first child x_1 is
# accepted with probability p(x_1); if rejected, x_1's mass is removed from p (p renormalised)
# and the next child is tested against that; a child accepted moves the test down to its own
# children under the target's p there; when every child of a node is rejected, the token is
# drawn from p with the rejected children removed. At every node this emits x with
# probability p(x) exactly: P(x_j) = (1 - p(x_1) - ... - p(x_{j-1})) * p(x_j) / (same), and a
# token no child holds keeps its share of the remainder. A row draws num_nodes + 1 uniforms
# every round, whatever it uses: what a seeded row draws depends on that row alone.


def greedy_tree_verify(
    token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_ids, parents [B, N], num_nodes [B], target_argmax [B, N+1] (by verify column) ->
    output_token_ids [B, N+1] (the accepted branch's tokens, then the target's token after it,
    -1 padding), num_accepted [B], and path [B, N+1]: the verify columns of the root and the
    accepted nodes, in order (0 padding)."""
    children = _children(parents, num_nodes)
    argmax = target_argmax.tolist()
    tokens = token_ids.tolist()
    results = []
    for row in range(len(children)):
        node, path = -1, [0]
        while True:
            wanted = argmax[row][node + 1]
            node = next((child for child in children[row].get(node, ()) if tokens[row][child] == wanted), None)
            if node is None:
                results.append((path, wanted))
                break
            path.append(node + 1)
    return _tree_outputs(token_ids, results)


def tree_rejection_sample(
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    target_probs: torch.Tensor,
    generators: list[torch.Generator],
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As greedy_tree_verify, sampled (see above): target_probs [B, N+1, V] are the target's
    warped distributions by verify column; generators one per row; greedy [B] bool|None:
    rows decided by greedy_tree_verify instead."""
    B, N = token_ids.shape
    device = target_probs.device
    children = _children(parents, num_nodes)
    tokens = token_ids.tolist()
    draws = uniforms(generators, (num_nodes + 1).tolist(), device).tolist()  # [B, <= N+1]
    # each node's probability under the target at its parent: p_parent(token) [B, N]
    parent_probs = target_probs.gather(1, (parents + 1)[:, :, None].expand(B, N, target_probs.shape[-1]))
    node_probs = parent_probs.gather(2, token_ids.clamp(min=0)[:, :, None]).squeeze(2).double().tolist()  # [B, N]
    results, final = [], []
    for row, count in enumerate(num_nodes.tolist()):
        row_draws = draws[row]
        node, path, used = -1, [0], 0
        while True:
            rejected, left = [], 1.0  # the tokens removed from p, and the mass p has left
            accepted = None
            for child in children[row].get(node, ()):
                p_child = node_probs[row][child] if tokens[row][child] not in rejected else 0.0
                u = row_draws[used]
                used += 1
                if u * left < p_child:
                    accepted = child
                    break
                rejected.append(tokens[row][child])
                left -= p_child
            if accepted is None:
                results.append((path, None))
                final.append((node + 1, rejected, row_draws[count]))  # the row's last draw
                break
            node = accepted
            path.append(node + 1)
    final_tokens = _draw_final(target_probs, final)
    results = [(path, token) for (path, _), token in zip(results, final_tokens)]
    output, num_accepted, path = _tree_outputs(token_ids, results)
    if greedy is not None and bool(greedy.any()):
        greedy_output, greedy_accepted, greedy_path = greedy_tree_verify(
            token_ids, parents, num_nodes, target_probs.argmax(-1)
        )
        output = torch.where(greedy[:, None], greedy_output, output)
        num_accepted = torch.where(greedy, greedy_accepted, num_accepted)
        path = torch.where(greedy[:, None], greedy_path, path)
    return output, num_accepted, path


def _children(parents: torch.Tensor, num_nodes: torch.Tensor) -> list[dict[int, list[int]]]:
    """Per row, each node's children (node -1: the root's) among its first num_nodes, in order."""
    out = []
    for row_parents, count in zip(parents.tolist(), num_nodes.tolist()):
        children: dict[int, list[int]] = {}
        for node in range(count):
            children.setdefault(row_parents[node], []).append(node)
        out.append(children)
    return out


def _draw_final(target_probs: torch.Tensor, final: list[tuple[int, list[int], float]]) -> list[int]:
    """The token after each row's accepted branch: from p at that row's column with its rejected
    children's tokens removed (from p itself if that leaves nothing)."""
    B, _, V = target_probs.shape
    rows = torch.arange(B, device=target_probs.device)
    columns = torch.tensor([column for column, _, _ in final], device=target_probs.device)
    p = target_probs[rows, columns].double()  # [B, V]
    residual = p.clone()
    for row, (_, rejected, _) in enumerate(final):
        if rejected:
            residual[row, rejected] = 0.0
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    u = torch.tensor([draw for _, _, draw in final], dtype=torch.float64, device=target_probs.device)
    return sample_with_uniforms(residual, u).tolist()


def _tree_outputs(
    token_ids: torch.Tensor, results: list[tuple[list[int], int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row (verify columns of the root and accepted nodes, final token) -> output_token_ids
    [B, N+1], num_accepted [B], path [B, N+1]."""
    B, N = token_ids.shape
    tokens = token_ids.tolist()
    output = torch.full((B, N + 1), -1, dtype=torch.long)
    path = torch.zeros(B, N + 1, dtype=torch.long)
    for row, (columns, final_token) in enumerate(results):
        accepted = [tokens[row][column - 1] for column in columns[1:]]
        output[row, : len(accepted) + 1] = torch.tensor(accepted + [final_token])
        path[row, : len(columns)] = torch.tensor(columns)
    num_accepted = torch.tensor([len(columns) - 1 for columns, _ in results])
    device = token_ids.device
    return output.to(device), num_accepted.to(device), path.to(device)
