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
    q_draft_token = (torch.ones_like(p_draft_token) if draft_probs is None
                     else draft_probs.gather(2, draft_ids).squeeze(2).double())  # [B, k]
    accept = (u[:, :k] * q_draft_token < p_draft_token) & proposed  # [B, k]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]: length of the accepted prefix
    u_final = u.gather(1, num_draft[:, None]).squeeze(1)  # [B]: each row's last draw
    final_token = _recovered_or_bonus(num_accepted, num_draft, draft_token_ids, draft_probs,
                                      target_probs, u_final)
    output = _assemble(draft_token_ids, num_accepted, final_token)
    if greedy is not None:
        greedy_output, greedy_accepted = greedy_verify(draft_token_ids, num_draft, target_probs.argmax(-1))
        output = torch.where(greedy[:, None], greedy_output, output)
        num_accepted = torch.where(greedy, greedy_accepted, num_accepted)
    return output, num_accepted


def greedy_verify(draft_token_ids: torch.Tensor, num_draft: torch.Tensor, target_argmax: torch.Tensor
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
