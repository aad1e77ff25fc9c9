"""The round loop: where the target, the drafter and the rejection sampler meet.

A round, for every running sequence at once:
  choose    the round's k: by goodput (goodput.py: expected tokens per second from each
            sequence's acceptance rate and the measured costs; 0 = plain decoding), or fixed
  propose   the drafter drafts up to k tokens per row (or, with a tree shape, a tree of up to
            k nodes: tree.py)
  verify    one target forward over [last token, drafts] gives p at every draft position
            and one past it; rejection sampling keeps a prefix (of a tree: a branch, whose
            K/V entries are then moved into the sequence's next positions) and adds one token
  emit      tokens are appended one by one, stopping at EOS / stop strings / max_tokens even
            inside an accepted run (output_processor.py); finished rows leave the batch and free
            their slot

Invariant between rounds: the target's cache holds K/V for every token of a sequence but
the last, which is fed first in the next round's verify forward.
"""

from __future__ import annotations

import time

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Draft, Drafter
from specdec.goodput import GoodputPolicy
from specdec.kv_cache import CacheTooLarge, TreeAttention
from specdec.metrics import SpecStats
from specdec.models.tokenizer import Tokenizer
from specdec.output_processor import OutputProcessor
from specdec.outputs import RequestOutput
from specdec.progress import stage
from specdec.runner import ForwardBatch, ModelRunner
from specdec.sampling import SamplingTensors, request_generator, sample, token_logprobs, warp
from specdec.scheduler import Scheduler
from specdec.sequence import Sequence
from specdec.tree import TreeShape, branches
from specdec.verify import greedy_tree_verify, greedy_verify, rejection_sample, tree_rejection_sample


CALIBRATION_CONTEXT = 128  # the positions the goodput policy's cost calibration runs at


class Engine:
    """k_policy: "goodput" (num_speculative_tokens is each round's largest k; see goodput.py)
    or "fixed" (every round drafts num_speculative_tokens, less only where a row has no room).
    tree: a tree shape (tree.py) other than "chain": every round drafts a tree of
    num_speculative_tokens nodes (its depth cut to each row's room), from a drafter that
    grows_trees; the goodput policy, which models chains, is not used."""

    def __init__(self, target: ModelRunner, drafter: Drafter | None, num_speculative_tokens: int,
                 eos_token_ids: tuple[int, ...], tokenizer: Tokenizer | None, max_num_seqs: int = 256,
                 k_policy: str = "goodput", tree: TreeShape | None = None, generator: torch.Generator | None = None):
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.tree = tree if tree is not None and not tree.is_chain and self.k else None
        if self.tree is not None and not drafter.grows_trees:
            raise ValueError(f"speculative_tree={str(tree)!r} needs a drafter that grows trees (a draft model, an "
                             f"EAGLE head or early exit); {type(drafter).__name__} drafts chains only: use "
                             "speculative_tree='chain'")
        self.hands_hidden = drafter is not None and drafter.needs_target_hidden  # the target's features too
        self.output = OutputProcessor(tokenizer, eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_len: int | None = None  # the positions each sequence may use, once prepared
        self.policy = None
        if self.k and k_policy == "goodput" and self.tree is None:
            self.policy = GoodputPolicy(self.k, self.target.padded_queries)
        self._sampling_key, self._sampling = None, None
        self.scheduler = Scheduler()
        self._unfinished: dict[str, Sequence] = {}  # by request id: waiting or running
        self.stats = SpecStats()  # every request's rounds, merged (the server's metrics read it)
        # the random stream of requests without a seed of their own
        self.shared_generator = generator if generator is not None else torch.Generator(target.device).manual_seed(0)
        self.timings = {"prefill": 0.0, "draft": 0.0, "target": 0.0, "sampling": 0.0, "bookkeeping": 0.0}

    # --- the step-based interface ------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, stream_text: bool = False) -> Sequence:
        """Queue a request (prompt_token_ids checked by the caller: LLM.prompt_token_ids); it
        starts at a step with a free slot. stream_text: each step's RequestOutput carries the
        request's new text too (its whole output is decoded at every step that adds tokens)."""
        generator = request_generator(params.seed, self.shared_generator, self.target.device)
        seq = Sequence(request_id, list(prompt_token_ids), params, generator, prompt=prompt, stream_text=stream_text)
        self.add_sequence(seq)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by the caller (LLM.generate makes its own)."""
        if seq.request_id in self._unfinished:
            raise ValueError(f"request id {seq.request_id!r} is already running or waiting; give each a new id")
        if self.max_len is not None and self._positions_needed(seq) > self.max_len:
            raise ValueError(f"a prompt of {len(seq.prompt_token_ids)} tokens + max_tokens={seq.params.max_tokens} "
                             f"needs {self._positions_needed(seq)} cache positions, and the engine was prepared for "
                             f"{self.max_len}; shorten the prompt or lower max_tokens")
        self._unfinished[seq.request_id] = seq
        self.scheduler.add(seq)

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests into free slots (their prefill samples each one's first
        token), run one round over every running request, retire the finished ones. Returns,
        for every request that moved, what is new since the last step (outputs.py)."""
        if self.max_len is None:
            self.prepare(list(self.scheduler.waiting))
        admitted = self.scheduler.admit()
        if admitted:
            self._prefill(admitted)
        running = [seq for seq in self.scheduler.running if not seq.finished]
        if running:
            self._round(running)
        for seq in self.scheduler.retire_finished():
            self._finish(seq)
        admitted_ids = {seq.request_id for seq in admitted}
        moved = admitted + [seq for seq in running if seq.request_id not in admitted_ids]
        return [output for output in map(self.output.new_output, moved) if output is not None]

    def abort(self, request_id: str) -> bool:
        """Stop a request, waiting or running; its slot is free for the next step. False if no
        such request is unfinished."""
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self._finish(seq, ran=seq.slot >= 0)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # --- sizing --------------------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> int:
        """Size the caches for generating seqs (and compile for it, where the runners are to);
        returns how many run at once."""
        max_batch = min(self.max_num_seqs, len(seqs))
        # room for the forwards of every k these requests can use, which calibration and warm-up
        # run (a k far beyond what they can emit is neither allocated nor timed)
        k = self._usable_k(seqs) if self.tree is None else self.k  # a tree's nodes are not cut to the room
        max_len = max(s.num_tokens + s.params.max_tokens for s in seqs) + self._margin(k) + 1
        waves = -(-len(seqs) // max_batch)
        self._reserve(max_batch, max_len, waves * max(s.params.max_tokens for s in seqs), k)
        self._start(max_batch)
        return max_batch

    def prepare_to_serve(self, max_model_len: int, kv_cache_bytes: int | None = None,
                         max_prefill_tokens: int | None = None) -> int:
        """Size the caches for serving requests of up to max_model_len tokens (prompt and
        output) each, as many at once as max_num_seqs and kv_cache_bytes (the target's cache; None:
        no limit but the free memory) allow; the goodput policy measures its costs at every batch
        size a power of two up to that. Compiles only under compile="on" (a compiled forward runs
        the whole batch of slots, however few requests there are). max_prefill_tokens: one step's
        prefill budget (scheduler.py). Returns the slots."""
        max_len = max_model_len + self._margin(self.k) + 1
        num_slots = self.max_num_seqs
        if kv_cache_bytes is not None:
            per_slot = self.target.model.cache_bytes(1, max_len)
            num_slots = min(num_slots, kv_cache_bytes // per_slot)
            if num_slots < 1:
                raise CacheTooLarge(f"one sequence of {max_len:,} positions needs {per_slot / 1e6:,.1f} MB of key/value "
                                    f"cache, more than the budget of {kv_cache_bytes / 1e6:,.1f} MB; lower "
                                    "max_model_len or raise the budget")
        self._reserve(num_slots, max_len, 0, self.k)
        if self.policy is not None:
            for batch_size in (1 << i for i in range(num_slots.bit_length())):
                self._calibrate(batch_size, max_len, self.k)
        self._start(num_slots, max_prefill_tokens)
        return num_slots

    def _start(self, num_slots: int, max_prefill_tokens: int | None = None) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError("the engine has unfinished requests: finish or abort them before preparing again")
        self.scheduler.resize(num_slots)
        self.scheduler.max_prefill_tokens = max_prefill_tokens
        self.reset_timings()
        self._sampling_key = None  # earlier requests may share ids with the next ones

    def reset_timings(self) -> None:
        for key in self.timings:
            self.timings[key] = 0.0

    def _margin(self, k: int) -> int:
        """Positions past a sequence's last token that a round may write: verify runs k past it,
        and a drafter growing a tree writes the nodes it expands."""
        return max(k, self.tree.max_expanded(k)) if self.tree is not None else k

    def _positions_needed(self, seq: Sequence) -> int:
        """Cache positions seq needs (the last one is kept free for padding: kv_cache.ragged_batch)."""
        k = self.k if self.tree is not None else min(self.k, seq.draft_room)  # a chain is cut to the room
        return seq.num_tokens + seq.params.max_tokens + self._margin(k) + 1

    def _reserve(self, max_batch: int, max_len: int, num_forwards: int, k: int) -> None:
        """Caches for the work ahead (at most num_forwards target forwards, k drafts a round at
        most); the runners compile for it if they are to, and the policy measures its costs."""
        # a fixed k verifies k drafts every round (fewer are padded); goodput may choose k = 0; a
        # tree's forwards run eagerly, and only rows without room run compiled (plain steps)
        if self.tree is not None:
            query_lengths = (1,)
        else:
            query_lengths = (1, self.k + 1) if self.policy is not None else (self.k + 1,)
        try:
            self.target.prepare(max_batch, max_len, query_lengths, num_forwards, return_hidden=self.hands_hidden)
            if self.drafter is not None:
                self.drafter.reserve(max_batch, max_len, num_forwards)
            self.max_len = self.target.max_len
        except CacheTooLarge as e:
            raise CacheTooLarge(f"{e}: {max_batch} sequences at once, each of up to {max_len:,} positions (prompt + "
                                "max_tokens + k + 1); lower max_tokens, or max_num_seqs") from None
        if self.policy is not None:
            self._calibrate(max_batch, max_len, k)

    def _calibrate(self, batch_size: int, max_len: int, k: int) -> None:
        """The goodput policy's costs at batch_size rows for every k up to k (once per batch
        bucket: goodput.py; a larger k later adds its lengths), measured here, before any
        request runs: never inside a timed generate."""
        with stage(f"timing the round costs of {batch_size} row{'s' if batch_size > 1 else ''} for k by goodput"):
            self.policy.calibrate(batch_size, k,
                                  lambda num_tokens: self._time_target(batch_size, num_tokens, max_len),
                                  lambda: self.drafter.time_step(batch_size))

    def warm_up(self, repeats: int = 2) -> None:
        """Run, untimed, every target forward this engine's rounds can take (1 to k + 1 tokens a
        row, all its slots) and a draft step, `repeats` times each: the first calls of a shape
        allocate, pack weights and pick kernels, which a timed request should not pay. After
        prepare(), before requests run (it writes where calibration does: _time_target)."""
        batch_size, max_len = self.scheduler.num_slots, self.max_len
        with torch.inference_mode():
            for _ in range(repeats):
                for num_tokens in range(1, min(self.k + 1, max_len - 1) + 1):  # the forwards the cache holds
                    self._time_target(batch_size, num_tokens, max_len)
                if self.drafter is not None:
                    self.drafter.time_step(batch_size)

    def _time_target(self, batch_size: int, num_tokens: int, max_len: int) -> None:
        """A target forward of num_tokens tokens per row for batch_size rows, for the policy to
        time, in slots 0..batch_size-1 before any sequence holds them, at positions from
        CALIBRATION_CONTEXT on (attention over as many keys as a typical prompt; what it
        writes there sits past every new sequence's length until that sequence overwrites it)."""
        device = self.target.device
        start = max(0, min(CALIBRATION_CONTEXT, max_len - num_tokens - 1))
        input_ids = torch.zeros(batch_size, num_tokens, dtype=torch.long, device=device)  # [B, T]
        positions = start + torch.arange(num_tokens, device=device).expand(batch_size, num_tokens)  # [B, T]
        self.target(ForwardBatch.of(input_ids, positions, range(batch_size)), return_hidden=self.hands_hidden)

    def _finish(self, seq: Sequence, ran: bool = True) -> None:
        """A sequence out of the batch (finished or aborted): its time, its final text; the
        drafter forgets it."""
        del self._unfinished[seq.request_id]
        seq.stats.seconds = time.perf_counter() - seq.arrival_time
        seq.text = self.output.final_text(seq)
        if ran and self.drafter is not None:
            self.drafter.release(seq)

    def _prefill(self, batch: list[Sequence]) -> None:
        """One target forward over the new prompts; samples each one's first token."""
        t0 = time.perf_counter()
        device = self.target.device
        prompts = [s.prompt_token_ids for s in batch]
        logits = self.target.feed(prompts, [0] * len(batch), [s.slot for s in batch],
                                  return_hidden=self.hands_hidden)  # [B, V] (, hidden [B, T, H])
        if self.hands_hidden:
            logits, hidden = logits
            prompt_lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)  # [B]
            self.drafter.observe_hidden(batch, torch.zeros_like(prompt_lengths), hidden, prompt_lengths)
        probs = warp(logits, SamplingTensors.from_params([s.params for s in batch], device))
        first_tokens = sample(probs, [s.generator for s in batch])  # [B]
        logprobs = _logprobs(batch, logits[:, None], first_tokens[:, None], torch.ones_like(first_tokens))
        for seq, token, first_logprob in zip(batch, first_tokens.tolist(), logprobs):
            emitted = self.output.append(seq, [token], num_from_draft=0, logprobs=first_logprob)
            seq.stats.record_round(0, 0, emitted)
            self.stats.record_round(0, 0, emitted)
            if self.policy is not None:
                self.policy.start(seq.slot)
        self.timings["prefill"] += time.perf_counter() - t0

    def _round(self, batch: list[Sequence]) -> None:
        device = self.target.device
        sampling = self._sampling_tensors(batch)
        slots = [s.slot for s in batch]
        ks = self._round_ks(batch, slots)  # each row's k (at most its room)
        t0 = time.perf_counter()
        draft, all_rows_drafted = self._propose(batch, ks, sampling)
        t1 = time.perf_counter()
        num_draft = draft.num_tokens if draft.is_tree else torch.minimum(draft.num_tokens, torch.tensor(ks, device=device))
        input_ids, positions, tree = self._verify_inputs(batch, draft)  # [B, k+1] each, and a tree's layout
        target_logits = self.target(ForwardBatch.of(input_ids, positions, slots, tree),
                                    return_hidden=self.hands_hidden)  # [B, k+1, V]
        if self.hands_hidden:
            target_logits, target_hidden = target_logits  # and [B, k+1, H]
        t2 = time.perf_counter()
        output, num_accepted, path = self._verify(batch, sampling, draft, num_draft, target_logits)
        if path is not None:  # the accepted branch's entries into place, its features in order
            self._keep_branch(slots, tree.write_positions, path, num_accepted)
            if self.hands_hidden:
                target_hidden = target_hidden.gather(1, path[:, :, None].expand(-1, -1, target_hidden.shape[-1]))
        t3 = time.perf_counter()
        num_proposed, num_accepted_list = num_draft.tolist(), num_accepted.tolist()
        tree_depths = _tree_depths(positions, num_draft).tolist() if draft.is_tree else [None] * len(batch)
        logprobs = _logprobs(batch, target_logits, output, num_accepted + 1, path)
        for row, seq in enumerate(batch):
            tokens = output[row, :num_accepted_list[row] + 1].tolist()
            emitted = self.output.append(seq, tokens, num_from_draft=num_accepted_list[row], logprobs=logprobs[row])
            for stats in (seq.stats, self.stats):
                stats.record_round(num_proposed[row], num_accepted_list[row], emitted, k=ks[row],
                                   depth=tree_depths[row])
        if self.drafter is not None:
            self.drafter.observe(batch, num_accepted)
        if self.hands_hidden:
            self.drafter.observe_hidden(batch, positions[:, 0], target_hidden, num_accepted + 1)
        if self.policy is not None:
            self.policy.observe(slots, num_proposed, num_accepted_list)
            self.policy.observe_round(len(batch), max(ks), input_ids.shape[1], target_seconds=t3 - t1,
                                      draft_seconds=t1 - t0 if all_rows_drafted else None)
        t4 = time.perf_counter()
        for key, seconds in (("draft", t1 - t0), ("target", t2 - t1), ("sampling", t3 - t2), ("bookkeeping", t4 - t3)):
            self.timings[key] += seconds

    def _round_ks(self, batch: list[Sequence], slots: list[int]) -> list[int]:
        """Each row's k this round: the goodput policy's choice, or the fixed k (each row cut to
        its room). A round with a seeded sampled request keeps the fixed k: its tokens depend on
        its rounds' k, which goodput takes from timings, and a seed must give the same tokens
        every run."""
        rooms = [s.draft_room for s in batch]
        if self.tree is not None:  # a tree of k nodes wherever there is room (its depth cut to it)
            return [self.k if room > 0 else 0 for room in rooms]
        if self.policy is None or any(s.params.seed is not None and not s.params.greedy for s in batch):
            k = self._usable_k(batch)
            return [min(k, room) for room in rooms]
        return self.policy.choose(slots, rooms)

    def _propose(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> tuple[Draft, bool]:
        """The drafter's tokens for the rows with k > 0 (up to the largest k); the rest propose
        nothing. Also whether every row drafted."""
        device = self.target.device
        rows = [row for row, k in enumerate(ks) if k > 0]
        if not rows:
            return Draft.empty(len(batch), device), False
        if len(rows) == len(batch):
            return self._draft(batch, ks, sampling), True
        index = torch.tensor(rows, device=device)  # [R]
        drafted = self._draft([batch[row] for row in rows], [ks[row] for row in rows], sampling.select_rows(index))
        return drafted.scattered(len(batch), index), False

    def _draft(self, batch: list[Sequence], ks: list[int], sampling: SamplingTensors) -> Draft:
        if self.tree is not None:  # every drafting row grows a tree of k nodes (its depth cut to its room)
            return self.drafter.propose_tree(batch, max(ks), self.tree, sampling)
        return self.drafter.propose(batch, ks, sampling)

    def _usable_k(self, seqs: list[Sequence]) -> int:
        """The round's k: no wider than the most drafts any row has room for (a larger k would
        be drafted and verified for nothing; each row is also cut to its own room)."""
        return min(self.k, max(s.draft_room for s in seqs))

    def _verify(self, batch, sampling: SamplingTensors, draft: Draft, num_draft: torch.Tensor,
                target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rejection sampling (greedy: prefix matching) -> output_token_ids [B, k+1], num_accepted [B],
        and for a tree the accepted branch's verify columns [B, k+1] (None for a chain)."""
        greedy = sampling.greedy if sampling.any_greedy else None
        if draft.is_tree:
            if sampling.all_greedy:
                return greedy_tree_verify(draft.token_ids, draft.parents, num_draft, target_logits.argmax(-1))
            return tree_rejection_sample(draft.token_ids, draft.parents, num_draft, self._warp(target_logits, sampling),
                                         [s.generator for s in batch], greedy)
        if sampling.all_greedy:  # no probabilities needed
            return *greedy_verify(draft.token_ids, num_draft, target_logits.argmax(-1)), None
        return *rejection_sample(draft.token_ids, num_draft, draft.probs, self._warp(target_logits, sampling),
                                 [s.generator for s in batch], greedy), None

    @staticmethod
    def _warp(target_logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
        """The target's warped distributions [B, T, V] from its logits [B, T, V]."""
        B, T, V = target_logits.shape  # T = k + 1
        return warp(target_logits.reshape(B * T, V), sampling.repeat_rows(T)).view(B, T, V)

    def _keep_branch(self, slots: list[int], write_positions: torch.Tensor, path: torch.Tensor,
                     num_accepted: torch.Tensor) -> None:
        """Move the K/V entries of each row's accepted branch (verify columns path [B, k+1],
        root first) to the positions right after the root's, as a chain's would lie; the rest
        (rejected nodes) stay past the sequence's length, to be overwritten."""
        sources = write_positions.gather(1, path[:, 1:])  # [B, k]
        destinations = write_positions[:, 1:]  # [B, k]: root position + 1..k
        accepted = torch.arange(sources.shape[1], device=sources.device)[None, :] < num_accepted[:, None]  # [B, k]
        root = write_positions[:, :1]  # [B, 1]: a no-op pair pads the rest
        self.target.move(slots, torch.where(accepted, sources, root), torch.where(accepted, destinations, root))

    def _sampling_tensors(self, batch: list[Sequence]) -> SamplingTensors:
        """The batch's settings as tensors, rebuilt only when the batch changes."""
        key = tuple(seq.request_id for seq in batch)
        if key != self._sampling_key:
            self._sampling_key = key
            self._sampling = SamplingTensors.from_params([s.params for s in batch], self.target.device)
        return self._sampling

    def _verify_inputs(self, batch: list[Sequence], draft: Draft
                       ) -> tuple[torch.Tensor, torch.Tensor, TreeAttention | None]:
        """[last token, d_1..d_k] at positions [L-1 .. L-1+k] per row: [B, k+1] each. For a tree,
        its nodes sit at L-1 + their depth, and its layout: column t (the root, then node t-1)
        is written at L-1 + t and reads the sequence before L-1 and its own branch."""
        device = self.target.device
        last_tokens = torch.tensor([s.last_token_id for s in batch], device=device)[:, None]  # [B, 1]
        input_ids = torch.cat([last_tokens, draft.token_ids], dim=1)  # [B, k+1]
        first_positions = torch.tensor([s.num_tokens - 1 for s in batch], device=device)  # [B]
        columns = torch.arange(input_ids.shape[1], device=device)  # [k+1]
        if not draft.is_tree:
            return input_ids, first_positions[:, None] + columns, None
        visible = branches(draft.parents)  # [B, k+1, k+1]
        depth = visible.sum(-1) - 1  # [B, k+1]: ancestors, the root included
        tree = TreeAttention(first_positions[:, None] + columns, first_positions, visible)
        return input_ids, first_positions[:, None] + depth, tree


def _logprobs(batch: list[Sequence], logits: torch.Tensor, token_ids: torch.Tensor, num_tokens: torch.Tensor,
              path: torch.Tensor | None = None) -> list[list | None]:
    """For each row whose request asks for logprobs, its first num_tokens[row] emitted tokens'
    (token_ids [B, T]; token j drawn from the distribution of logits [B, T, V] at column j, or for
    a tree at column path[row, j], its branch's): a list of TokenLogprob; None for the other rows."""
    logprobs: list[list | None] = [None] * len(batch)
    for row, seq in enumerate(batch):
        if seq.params.logprobs is not None:
            n = int(num_tokens[row])
            columns = path[row, :n] if path is not None else torch.arange(n, device=logits.device)  # [n]
            logprobs[row] = token_logprobs(logits[row, columns], token_ids[row, :n], seq.params.logprobs)
    return logprobs


def _tree_depths(positions: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Each row's tree depth [B] from its verify positions [B, k+1] (root first, nodes at the
    root's + their depth) and its node count [B]."""
    columns = torch.arange(positions.shape[1], device=positions.device)[None, :]  # [1, k+1]
    offsets = (positions - positions[:, :1]).masked_fill(columns > num_nodes[:, None], 0)  # [B, k+1]
    return offsets.max(dim=1).values
