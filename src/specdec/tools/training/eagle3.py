"""`specdec train-heads TARGET --eagle3 --data CHAT_DATA`: an EAGLE-3 head, trained over the
target's features computed once and stored on disk.

    specdec train-heads TARGET --eagle3 --data DIR --out HEAD [--features DIR] [--ttt-steps 4]
        [--output-vocab 32768] [--head-intermediate N] [training flags]

Terms (models/eagle.py defines feature, head and EAGLE-3):
  document        one file of a chat-data corpus (`specdec chat-data`): a conversation rendered by
                  the target's chat template, the target's own answer included
  answer tokens   a document's tokens after its last generation prompt (the assistant header):
                  the text the head will draft; the loss is over the positions that predict them
  stored features per token of every document, in FEATURES (default OUT.features/, kept beside
                  the run): the outputs of the target's feature_layers [n x hidden] (bfloat16),
                  the target's top_k most likely next tokens and their log-probabilities (its
                  distribution there, p, cut to where almost all of its mass is), and whether the
                  next token is an answer token. The target runs over each document once; a
                  stopped feature pass resumes at the first document it had not finished, and a
                  corpus that has gained documents since (chat-data still writing) gets theirs
                  added after the others.
  text corpus     (--text) plain text beside the chat answers, e.g. the Python standard library:
                  the target's features over it are cheap to make (a prefill, no answers to
                  generate), so it is where a head gets most of its tokens. Its documents are
                  shuffled (seed 0), tokenized and cut into pieces of at most TEXT_PIECE_TOKENS,
                  up to --text-tokens tokens in all, each stored as a training document whose
                  every token counts as an answer token (the head learns to draft all of it).
                  The held-out evaluation stays on the chat answers.
  training-time test (TTT)
                  the head is run ttt_steps times over each window, as drafting runs it: step 0
                  reads the fused target features f_t with token t+1 at position t; step j reads
                  its own step j-1 prediction at index t with token t+1+j at position t+j, and
                  attends, as at drafting time, to the real entries 0..t (step 0's) and to its own
                  entries of steps 1..j at index t (the draft tokens before it in the same chain).
                  Step j's prediction at index t is scored against p at position t+1+j (the token
                  t+2+j); step j's loss weighs step_decay**j (EAGLE-3's 0.8).
  loss            per step: the cross-entropy of the head's distribution q over its scored tokens
                  (output_vocab, FR-Spec) against p restricted to them and renormalised, averaged
                  over the positions that predict answer tokens.

Evaluation, on the held-out documents' windows: per step j, the agreement (argmax q is the
target's most likely token: at step 0 the first draft token's greedy acceptance, at step j the
(j+1)-th's given the head's own earlier features) and the loss; and tau_estimate = 1 + sum over j
of the product of the agreements up to j, the accepted length a greedy chain of ttt_steps tokens
would reach if each step's agreement were independent of the ones before (an estimate: the bench
measures the real one).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.config import check, is_int, is_real
from specdec.models.eagle import (
    HEAD_CONFIG,
    HEAD_WEIGHTS,
    EagleHead,
    eagle3_feature_layers,
    head_config,
    head_mismatch,
    load_head,
    save_head,
)
from specdec.models.loader import LoadedModel, load_pretrained
from specdec.output_dir import OutputDir, check_written_in_place, said_when_disk_full
from specdec.platform import cpu_model
from specdec.tools.training.corpus import HELD_OUT_DIRECTORY, Corpus, load_corpus
from specdec.tools.training.distill import frequent_share, frequent_tokens
from specdec.tools.training.heads import HEAD_RUN_ENTRIES, _plain, check_output_vocab, output_layer_words
from specdec.tools.training.loop import Task, TrainConfig, log, train_loop
from specdec.tools.training.model_card import command_line
from specdec.tools.training.train import (
    CHECKPOINT_DIR,
    SAVE_DTYPES,
    TrainResult,
    check_save_dtype,
    finish_run,
    initialise,
    open_run_output,
    resume_checkpoint,
)

KIND = "train-heads-eagle3"
FEATURES_FORMAT = "specdec-eagle3-features"
FEATURES_MANIFEST = "features.json"
FEATURES_ENTRIES = (FEATURES_MANIFEST, FEATURES_MANIFEST + ".part", "train/*", "held_out/*")  # what a pass writes
SPLITS = {"train": "train", "held_out": HELD_OUT_DIRECTORY}
MIN_CONTEXT = 32  # a window's queries per step must outnumber the attention kernel's (autograd-free) rows
TEXT_PIECE_TOKENS = 1024  # a text corpus's documents are stored in pieces of at most this many tokens
DEFAULT_TEXT_TOKENS = 1_000_000  # --text-tokens
TEXT_STDLIB = "stdlib"  # --text stdlib: the Python standard library (corpus.py's default corpus)
TEXT_PREFIX = "text:"  # the stored names of a text corpus's pieces: text:<document>:<piece>
DEFAULT_OUTPUT_VOCAB = 32768  # the tokens a head scores when --output-vocab is not given


@dataclass(frozen=True)
class Eagle3Config:
    """What an EAGLE-3 head is and how it is taught (see the module docstring).

    feature_layers: the target layers it reads; None: models/eagle.eagle3_feature_layers.
    ttt_steps: drafting steps unrolled in training (>= 1).
    step_decay: step j's loss weight is step_decay**j, in (0, 1].
    context: tokens per training window (>= MIN_CONTEXT + ttt_steps).
    output_vocab: the tokens the head scores (the most frequent in the training answers, and
        the end-of-text tokens); 0: every token the target scores (its whole vocabulary, or the
        tokens its output layer scores where that is part of it); None: DEFAULT_OUTPUT_VOCAB, or
        every token where the target scores no more (scored_vocabulary).
    intermediate_size: the head's MLP width; None: the target's.
    top_k: the target's most likely next tokens stored per position (its distribution there).
    """

    feature_layers: tuple[int, ...] | None = None
    ttt_steps: int = 4
    step_decay: float = 0.8
    context: int = 512
    output_vocab: int | None = None
    intermediate_size: int | None = None
    top_k: int = 32

    def __post_init__(self) -> None:
        check(
            is_int(self.ttt_steps) and self.ttt_steps >= 1, f"ttt_steps must be an integer >= 1, got {self.ttt_steps!r}"
        )
        check(
            is_real(self.step_decay) and 0 < self.step_decay <= 1,
            f"step_decay must be in (0, 1], got {self.step_decay!r}",
        )
        check(
            is_int(self.context) and self.context >= MIN_CONTEXT + self.ttt_steps,
            f"context must be an integer >= {MIN_CONTEXT + self.ttt_steps} ({MIN_CONTEXT} queries per step "
            f"after {self.ttt_steps} TTT steps), got {self.context!r}",
        )
        check(
            self.output_vocab is None or (is_int(self.output_vocab) and self.output_vocab >= 0),
            f"output_vocab must be an integer >= 0 (0: the whole vocabulary), got {self.output_vocab!r}",
        )
        check(
            self.intermediate_size is None or (is_int(self.intermediate_size) and self.intermediate_size >= 1),
            f"intermediate_size must be an integer >= 1 or None (the target's), got {self.intermediate_size!r}",
        )
        check(is_int(self.top_k) and self.top_k >= 1, f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.feature_layers is not None:
            layers = tuple(self.feature_layers)
            check(
                len(layers) >= 1 and all(is_int(i) and i >= 0 for i in layers) and list(layers) == sorted(set(layers)),
                f"feature_layers must be distinct ascending layer indices, got {self.feature_layers!r}",
            )
            object.__setattr__(self, "feature_layers", layers)

    def layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The target layers read, for a target of num_layers layers."""
        layers = self.feature_layers if self.feature_layers is not None else eagle3_feature_layers(num_layers)
        check(
            layers[-1] < num_layers,
            f"feature_layers {list(layers)} reach past the target's {num_layers} layers (0..{num_layers - 1})",
        )
        return layers


def scored_vocabulary(asked: int | None, target: LoadedModel) -> int:
    """The output_vocab a head of target is made with, for Eagle3Config's output_vocab (asked;
    None: not given). Not given: DEFAULT_OUTPUT_VOCAB, cut to every token the target scores (0)
    where it scores no more or its output layer is reduced (heads.output_layer_words), said in
    the log; given: as heads.check_output_vocab allows."""
    config = target.model.config
    if asked is not None:
        return check_output_vocab(asked, target)
    if DEFAULT_OUTPUT_VOCAB < config.head_size and not config.output_vocab_size:
        return DEFAULT_OUTPUT_VOCAB
    log(f"{output_layer_words(config)}: the head scores all of them (by default {DEFAULT_OUTPUT_VOCAB:,} at most)")
    return 0


# --- the stored features -------------------------------------------------------------------


@dataclass
class FeatureArrays:
    """One split's stored features, memory-mapped: N tokens of the documents one after another.

    token_ids [N] int32; features [N, F] bfloat16 (F = n x hidden); top_ids [N, K] int32 and
    top_logprobs [N, K] float16: the target's K most likely tokens after each position and their
    log-probabilities; answer_next [N] bool: the next token is an answer token."""

    token_ids: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    answer_next: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def windows(self, starts: list[int], length: int) -> FeatureArrays:
        """The windows [start, start + length) stacked: every field gains a leading [B]."""

        def stack(t: torch.Tensor) -> torch.Tensor:
            return torch.stack([t[s : s + length] for s in starts])

        with torch.autocast("cpu", enabled=False):  # autocast's stack refuses float16 on the CPU
            return FeatureArrays(*(stack(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def to(self, device: torch.device) -> FeatureArrays:
        """Every field on device."""
        return FeatureArrays(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


FILES = {  # field -> (file name, numpy dtype the bytes are stored as)
    "token_ids": ("token_ids.i32", np.int32),
    "features": ("features.bf16", np.uint16),
    "top_ids": ("top_ids.i32", np.int32),
    "top_logprobs": ("top_logprobs.f16", np.float16),
    "answer_next": ("answer_next.u8", np.uint8),
}


def read_features(directory: Path) -> tuple[dict, dict[str, FeatureArrays]]:
    """The manifest and each split's arrays of a finished feature directory."""
    manifest = _read_manifest(directory)
    if manifest is None or not manifest.get("finished"):
        raise ValueError(f"{directory} holds no finished feature pass; run the same train-heads command to finish it")
    arrays = {}
    for split in SPLITS:
        count = manifest["splits"][split]["tokens"]
        width = {"features": manifest["feature_width"], "top_ids": manifest["top_k"], "top_logprobs": manifest["top_k"]}
        fields = {}
        for name, (file, dtype) in FILES.items():
            shape = (count, width[name]) if name in width else (count,)
            values = (
                np.memmap(directory / split / file, dtype=dtype, mode="c", shape=shape)
                if count
                else np.zeros(shape, dtype)
            )
            tensor = torch.from_numpy(np.asarray(values))
            fields[name] = _as_torch(name, tensor)
        arrays[split] = FeatureArrays(**fields)
    return manifest, arrays


def _as_torch(name: str, stored: torch.Tensor) -> torch.Tensor:
    if name == "features":
        return stored.view(torch.bfloat16)
    if name == "answer_next":
        return stored.bool()
    return stored


def _read_manifest(directory: Path) -> dict | None:
    file = directory / FEATURES_MANIFEST
    if not file.is_file():
        return None
    manifest = json.loads(file.read_text())
    return manifest if manifest.get("format") == FEATURES_FORMAT else None


def corpus_documents(data: Path) -> dict[str, list[Path]]:
    """A chat-data corpus's documents per split, in name order."""
    documents = {split: sorted((data / sub).glob("*.txt")) for split, sub in SPLITS.items()}
    if not documents["train"]:
        raise ValueError(f"{data} has no train/*.txt documents: give a corpus `specdec chat-data` wrote")
    if not documents["held_out"]:
        raise ValueError(f"{data} has no {HELD_OUT_DIRECTORY}/*.txt documents to evaluate on")
    return documents


def answer_header(tokenizer) -> str:
    """What the chat template puts before an answer (the generation prompt)."""
    messages = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    header = with_prompt.removeprefix(without)
    if not header or header == with_prompt:
        raise ValueError("the target's chat template adds no generation prompt: its answers cannot be found")
    return header


def document_tokens(text: str, tokenizer, header: str) -> tuple[list[int], int]:
    """text's token ids and the index of its first answer token (the first token that holds a
    character after the last generation prompt, which may begin inside it, as a space the header
    ends with and the word after it make one token; len(ids) where there is none)."""
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    where = text.rfind(header)
    answer_char = where + len(header) if where >= 0 else len(text)
    first = next((i for i, (_, end) in enumerate(encoding.offsets) if end > answer_char), len(encoding.ids))
    return list(encoding.ids), first


@dataclass(frozen=True)
class SourceDocument:
    """A document of the features pass: its stored name and a function giving its token ids
    and the index of its first answer token."""

    name: str
    tokens: Callable[[], tuple[list[int], int]]


def chat_documents(data: Path, tokenizer) -> dict[str, list[SourceDocument]]:
    """A chat-data corpus's documents per split, each read when its turn comes."""
    header = answer_header(tokenizer)

    def reader(file: Path) -> Callable[[], tuple[list[int], int]]:
        return lambda: document_tokens(file.read_text(), tokenizer, header)

    return {
        split: [SourceDocument(f.name, reader(f)) for f in files] for split, files in corpus_documents(data).items()
    }


def text_pieces(corpus: Corpus, tokenizer, max_tokens: int) -> list[SourceDocument]:
    """The --text corpus's training documents as pieces of the target's tokens, every token an
    answer token (see the module docstring)."""
    order = torch.randperm(len(corpus.train), generator=torch.Generator().manual_seed(0)).tolist()
    pieces, total = [], 0
    for index in order:
        document = corpus.train[index]
        ids = tokenizer.backend.encode(document.text, add_special_tokens=False).ids
        for number, start in enumerate(range(0, len(ids), TEXT_PIECE_TOKENS)):
            piece = ids[start : start + TEXT_PIECE_TOKENS][: max_tokens - total]
            if len(piece) < 2:  # a piece must predict a token
                continue
            pieces.append(SourceDocument(f"{TEXT_PREFIX}{document.name}:{number}", lambda piece=piece: (piece, 0)))
            total += len(piece)
            if total >= max_tokens:
                return pieces
    return pieces


def compute_features(
    target: LoadedModel,
    layers: tuple[int, ...],
    top_k: int,
    data: Path,
    directory: Path,
    progress=log,
    text: Sequence[SourceDocument] = (),
    documents: dict[str, list[SourceDocument]] | None = None,
) -> dict:
    """Run the target once over every document of the corpus in data (and the text corpus's
    pieces, text_pieces) and store its features in directory (see the module docstring); a pass
    stopped part way resumes. documents: each split's documents instead of data's (recorded
    traffic: adapt.py). Returns the manifest."""
    model, tokenizer = target.model, target.tokenizer
    assert tokenizer is not None
    documents = chat_documents(data, tokenizer) if documents is None else dict(documents)
    documents["train"] = documents["train"] + list(text)
    identity = {
        "format": FEATURES_FORMAT,
        "target": str(target.path),
        "feature_layers": list(layers),
        "top_k": top_k,
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    manifest = _read_manifest(directory)
    if manifest is None or {k: manifest.get(k) for k in identity} != identity:
        manifest = {**identity, "splits": {s: {"documents": [], "tokens": 0} for s in SPLITS}}
    directory.mkdir(parents=True, exist_ok=True)
    model.set_feature_layers(layers)
    manifest["feature_width"] = len(layers) * model.config.hidden_size
    manifest["finished"] = False
    todo = {split: _not_stored(files, manifest["splits"][split]["documents"]) for split, files in documents.items()}
    total, done_tokens, done_documents = sum(len(files) for files in todo.values()), 0, 0
    progress(f"features: {total} documents to read ({sum(len(d) for d in documents.values()) - total} stored)")
    started = time.perf_counter()
    for split, files in todo.items():
        record = manifest["splits"][split]
        outputs = _Appender(directory / split, record["tokens"])
        try:
            for document in files:
                ids, first_answer = document.tokens()
                outputs.write(_document_features(model, ids, first_answer, top_k))
                record["documents"].append(document.name)
                record["tokens"] += len(ids)
                done_tokens, done_documents = done_tokens + len(ids), done_documents + 1
                _write_manifest(directory, manifest, outputs)
                if done_documents % 50 == 0 or done_documents == total:
                    seconds = time.perf_counter() - started
                    left = (total - done_documents) * seconds / done_documents
                    progress(
                        f"features: {done_documents}/{total} documents, {done_tokens / seconds:.0f} tokens/s, "
                        f"~{left / 60:.0f} min left"
                    )
        finally:
            outputs.close()
    manifest["finished"] = True
    _write_manifest(directory, manifest, None)
    return manifest


def _not_stored(documents: list[SourceDocument], stored: list[str]) -> list[SourceDocument]:
    """The documents whose features are not stored yet (a corpus still being written gains
    documents: a later pass adds theirs after the stored ones)."""
    names = set(stored)
    return [document for document in documents if document.name not in names]


def _document_features(model, ids: list[int], first_answer: int, top_k: int) -> dict[str, np.ndarray]:
    """One document's rows of each stored field (see FeatureArrays)."""
    token_ids = torch.tensor([ids], device=model.device)  # [1, T]
    positions = torch.arange(len(ids), device=model.device)[None]  # [1, T]
    with torch.inference_mode():
        hidden, features = model.hidden_and_features(token_ids, positions, None)  # [1, T, H], [1, T, F]
        logprobs = model.logits(hidden[0]).log_softmax(-1)  # [T, V]
        top_logprobs, top_ids = logprobs.topk(top_k, dim=-1)  # [T, K] each
    answer_next = torch.zeros(len(ids), dtype=torch.uint8)
    answer_next[max(first_answer - 1, 0) : len(ids) - 1] = 1  # position t predicts token t+1
    return {
        "token_ids": np.asarray(ids, dtype=np.int32),
        "features": features[0].to(torch.bfloat16).view(torch.uint16).cpu().numpy(),
        "top_ids": top_ids.to(torch.int32).cpu().numpy(),
        "top_logprobs": top_logprobs.to(torch.float16).cpu().numpy(),
        "answer_next": answer_next.numpy(),
    }


class _Appender:
    """A split's files open for appending documents' rows after the first `tokens` rows (rows a
    stopped pass wrote after the manifest's last record are written over)."""

    def __init__(self, split_dir: Path, tokens: int):
        split_dir.mkdir(parents=True, exist_ok=True)
        self.tokens = tokens
        self.handles = {}
        for name, (file, _) in FILES.items():
            (split_dir / file).touch()
            self.handles[name] = (split_dir / file).open("r+b")

    def write(self, rows: dict[str, np.ndarray]) -> None:
        for name, values in rows.items():
            handle = self.handles[name]
            row_bytes = values.nbytes // len(values)
            handle.truncate(self.tokens * row_bytes)
            handle.seek(self.tokens * row_bytes)
            handle.write(values.tobytes())
        self.tokens += len(rows["token_ids"])

    def flush(self) -> None:
        for handle in self.handles.values():
            handle.flush()

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def _write_manifest(directory: Path, manifest: dict, outputs: _Appender | None) -> None:
    if outputs is not None:
        outputs.flush()
    partial = directory / (FEATURES_MANIFEST + ".part")
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    partial.replace(directory / FEATURES_MANIFEST)


# --- training-time test ----------------------------------------------------------------------


class StepKeys:
    """The head's keys and values over the TTT steps so far, as a cache its layer writes to and
    reads from: step j's [B, W] entries go after those of steps 0..j-1 ([B, (j+1) W, Hkv, D])."""

    static = False

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.written = 0  # entries per row so far (of the layers' first)

    def num_keys(self, positions: torch.Tensor) -> int:
        return self.written + positions.shape[1]

    def write_and_read(self, layer: int, positions, k: torch.Tensor, v: torch.Tensor, num_keys: int):
        if layer in self.keys:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=1)  # [B, S + W, Hkv, D]
            self.values[layer] = torch.cat([self.values[layer], v], dim=1)
        else:
            self.keys[layer], self.values[layer] = k, v
        if layer == 0:
            self.written = self.keys[0].shape[1]
        return self.keys[layer], self.values[layer]


class StepMask:
    """What step `step`'s queries (index t, at position t + step) read: step 0's entries 0..t
    and the entries of steps 1..step at their own index t (kv_cache.TreeAttention's role)."""

    def __init__(self, positions: torch.Tensor, step: int):
        self.write_positions = positions  # [B, W]
        self.step = step

    def mask(self, num_keys: int, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        B, W = positions.shape
        index = torch.arange(W, device=positions.device)
        causal = index[None, :] <= index[:, None]  # [W, W]: key s <= query t
        diagonal = torch.eye(W, dtype=torch.bool, device=positions.device)  # [W, W]
        blocks = [causal] + [diagonal] * self.step  # [W, (step + 1) W]
        mask = torch.cat(blocks, dim=1)[None, None].expand(B, 1, W, num_keys)  # [B, 1, W, S]
        if window is not None:
            raise ValueError("an EAGLE-3 head attends over its whole window (no sliding window)")
        return mask


def ttt_predictions(head: EagleHead, embed, token_ids: torch.Tensor, features: torch.Tensor, steps: int) -> list:
    """The head's predicted features of each TTT step, [B, W, H] each (W = T - steps), for
    token_ids [B, T] and the target's features [B, T, F] (see the module docstring)."""
    B, T = token_ids.shape
    W = T - steps
    fed = head.fuse_features(features[:, :W])  # [B, W, F] -> [B, W, H]
    keys = StepKeys()
    index = torch.arange(W, device=token_ids.device).expand(B, W)  # [B, W]
    predictions = []
    for step in range(steps):
        positions = index + step  # [B, W]
        tokens = token_ids[:, 1 + step : 1 + step + W]  # [B, W]: token t+1+step
        with torch.no_grad():
            embeddings = embed(tokens).to(fed.dtype)  # [B, W, H]
        predicted = head(embeddings, fed, positions, keys, tree=StepMask(positions, step))  # [B, W, H]
        predictions.append(predicted)
        fed = predicted
    return predictions


@dataclass
class StepTargets:
    """Step j's targets: index [B, W, K] of the target's top tokens among the head's scored ones
    (-1: not scored), their probabilities p [B, W, K] (renormalised over the scored), and which
    positions count [B, W] (the next token is an answer's and p has mass on scored tokens)."""

    index: torch.Tensor
    probs: torch.Tensor
    counts: torch.Tensor
    top_index: torch.Tensor  # [B, W]: the target's most likely token among the scored, -1 if not scored


def step_targets(batch: FeatureArrays, step: int, width: int, scored_index: torch.Tensor) -> StepTargets:
    """The target's distribution at positions t + 1 + step (t < width), over the scored tokens.
    scored_index [V]: each vocabulary id's row in the head's output layer, -1 if not scored."""
    span = slice(1 + step, 1 + step + width)
    index = scored_index[batch.top_ids[:, span].long()]  # [B, W, K]
    probs = batch.top_logprobs[:, span].float().exp() * (index >= 0)  # [B, W, K]
    mass = probs.sum(-1)  # [B, W]
    counts = batch.answer_next[:, span] & (mass > 0)
    return StepTargets(index, probs / mass.clamp_min(1e-12)[..., None], counts, index[..., 0])


def step_loss(scores: torch.Tensor, targets: StepTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy of softmax(scores [B, W, S]) against the targets, averaged over the
    positions that count; and the greedy agreement there (argmax q is the target's top token)."""
    log_q = scores.float().log_softmax(-1)  # [B, W, S]
    picked = log_q.gather(-1, targets.index.clamp_min(0))  # [B, W, K]
    cross_entropy = -(targets.probs * picked).sum(-1)  # [B, W]
    weights = targets.counts.float()
    total = weights.sum().clamp_min(1.0)
    agreement = ((scores.argmax(-1) == targets.top_index) & targets.counts).float().sum() / total
    return (cross_entropy * weights).sum() / total, agreement


def ttt_loss(head, embed, output_layer, batch: FeatureArrays, scored_index, config: Eagle3Config):
    """The weighted sum of the steps' losses, and per step (loss, agreement) as floats."""
    steps = config.ttt_steps
    width = batch.token_ids.shape[1] - steps
    predictions = ttt_predictions(head, embed, batch.token_ids.long(), batch.features, steps)
    losses, per_step = [], []
    for step, predicted in enumerate(predictions):
        scores = output_layer(predicted.to(output_layer.weight.dtype))  # [B, W, S]
        loss, agreement = step_loss(scores, step_targets(batch, step, width, scored_index))
        losses.append(config.step_decay**step * loss)
        per_step.append((float(loss.detach()), float(agreement)))
    return torch.stack(losses).sum(), per_step


def tau_estimate(agreements: list[float]) -> float:
    """1 + the sum over j of the product of the agreements of steps 0..j."""
    tau, running = 1.0, 1.0
    for agreement in agreements:
        running *= agreement
        tau += running
    return tau


# --- the run -----------------------------------------------------------------------------------


def answer_tokens(arrays: FeatureArrays) -> torch.Tensor:
    """The answer tokens of the stored documents [N'] (the tokens after positions marked answer_next)."""
    return arrays.token_ids[1:][arrays.answer_next[:-1]].long()


def train_eagle3(
    target_path: str | Path,
    data: str | Path,
    out: str | Path,
    config: TrainConfig,
    eagle3: Eagle3Config = Eagle3Config(),
    features_dir: str | Path | None = None,
    save_dtype: str = "bfloat16",
    restart: bool = False,
    require_checkpoint: bool = False,
    arguments: dict | None = None,
    force: bool = False,
    text: str | Path | None = None,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    init_head: str | Path | None = None,
    documents: dict[str, list[SourceDocument]] | None = None,
    data_flag: str = "--data",
) -> TrainResult:
    """Store the target's features over the chat-data corpus in data (and text_tokens tokens of
    the text corpus text: a directory or file, or TEXT_STDLIB; None: none) once, then train (or
    resume training) an EAGLE-3 head over them and write it to out. init_head: an EAGLE-3 head's
    directory of the same shape whose weights (and scored tokens) the run starts from, to go on
    training a head (a shipped one) on more data; None: random weights. documents: each split's
    documents, read from data by the caller (adapt.py: recorded traffic, data_flag its flag)."""
    data, out = Path(data).expanduser(), Path(out).expanduser()
    check_save_dtype(save_dtype)
    target = load_pretrained(target_path, "auto", config.device, what="the target", keep_quantized=True)
    if documents is None and (target.tokenizer is None or not target.tokenizer.chat_template):
        raise ValueError(f"the target {target_path} needs a tokenizer with a chat template to read chat-data")
    layers = eagle3.layers_for(target.model.config.num_layers)
    eagle3 = dataclasses.replace(eagle3, output_vocab=scored_vocabulary(eagle3.output_vocab, target))
    check(is_int(text_tokens) and text_tokens >= 1, f"--text-tokens must be an integer >= 1, got {text_tokens!r}")
    inputs = {"TARGET": Path(str(target.path)), data_flag: data}
    if text is not None and str(text) != TEXT_STDLIB:
        inputs["--text"] = Path(text).expanduser()
    if init_head is not None:
        init_head = Path(init_head).expanduser()
        inputs["--init-head"] = init_head
    with open_run_output(out, KIND, inputs, force, HEAD_RUN_ENTRIES) as output:
        features_dir = check_features_dir(features_dir, output, inputs, force)
        checkpoint = resume_checkpoint(output, restart, require_checkpoint)
        pieces = []
        if text is not None:
            corpus = load_corpus(None if str(text) == TEXT_STDLIB else text)
            pieces = text_pieces(corpus, target.tokenizer, text_tokens)
            log(f"text: {corpus.describe()}; {len(pieces):,} pieces of at most {TEXT_PIECE_TOKENS} tokens")
        log(f"features: the target's layers {list(layers)} and its top {eagle3.top_k} tokens, into {features_dir}")
        with said_when_disk_full(features_dir, "the target's features", lambda: _features_kept(features_dir)):
            compute_features(target, layers, eagle3.top_k, data, features_dir, text=pieces, documents=documents)
        manifest, arrays = read_features(features_dir)
        train, held_out = arrays["train"], arrays["held_out"]
        context = eagle3.context
        for name, split in (("training", train), ("held-out", held_out)):
            check(
                split.num_tokens >= context,
                f"the {name} documents hold {split.num_tokens} tokens, fewer than one window of --context {context}",
            )
        target_config = target.model.config
        # eagle3.output_vocab was set by scored_vocabulary above (never None here)
        shape = head_config(target_config, eagle3.output_vocab or 0, eagle3.intermediate_size)
        head = initialise(EagleHead(shape, layers), 1, config.seed).to(config.device)
        if init_head is not None:
            start_from(head, init_head, target_config)
            log(f"starting from {init_head}'s weights and scored tokens")
        elif eagle3.output_vocab:
            answers = answer_tokens(train)
            count = min(eagle3.output_vocab, target_config.vocab_size)
            ids = frequent_tokens(answers, target_config.vocab_size, count, always=tuple(target.eos_token_ids))
            head.output_token_ids.copy_(ids)
            share = frequent_share(answers, ids)
            log(f"the head scores {len(ids):,} tokens: {share:.1%} of the training answers' tokens")
        identity = {
            "kind": KIND,
            "model": dataclasses.asdict(shape),
            "feature_layers": list(layers),
            "eagle3": _plain(dataclasses.asdict(eagle3)),
            "features": {k: manifest[k] for k in ("target", "top_k", "dtype", "splits")},
            "init_head": None if init_head is None else str(init_head),
        }
        task = eagle3_task(head, target, train, held_out, config, eagle3, identity)
        log(
            f"head {head.num_parameters / 1e6:.2f}M parameters; {train.num_tokens:,} training tokens, "
            f"{held_out.num_tokens:,} held out"
        )
        state = train_loop(task, config, output.staging / CHECKPOINT_DIR, checkpoint)
        settings = {
            "target": str(target.path),
            "data": str(data),
            "text": None if text is None else str(text),
            "text_tokens": sum(len(piece.tokens()[0]) for piece in pieces),
            "init_head": None if init_head is None else str(init_head),
            "features": str(features_dir),
            "eagle3": dataclasses.asdict(eagle3),
            "feature_layers": list(layers),
            "model": dataclasses.asdict(shape),
            "scored_tokens": head.config.output_vocab_size or target_config.head_size,
            "head_parameters": head.num_parameters,
            "training_tokens": train.num_tokens,
            "held_out_tokens": held_out.num_tokens,
        }

        def save(directory: Path) -> None:
            save_head(
                head,
                directory,
                SAVE_DTYPES[save_dtype],
                target=str(target.path),
                extra={"training": {"steps": state.step, "last_evaluation": state.evaluations[-1]}},
            )

        return finish_run(output, KIND, config, settings, state, arguments, save, write_eagle3_card)


def check_features_dir(given, output: OutputDir, inputs: dict, force: bool) -> Path:
    """The features directory (given: --features; None: OUT.features beside the run's output),
    checked as output directories are (output_dir.check_written_in_place): never one of the
    run's inputs or its output, and a non-empty directory only when it holds stored features
    (or with force)."""
    if given is None or not str(given).strip():
        given = output.final.with_name(output.final.name + ".features")
    places = {**inputs, "--out": output.final, "--out's staging directory": output.staging}
    return check_written_in_place(
        given, "--features", "train-heads --eagle3", places, force, _holds_features, FEATURES_ENTRIES
    )


def _holds_features(directory: Path) -> bool:
    try:
        return _read_manifest(directory) is not None
    except (OSError, ValueError, AttributeError):  # a features.json that is not ours, or not JSON
        return False


def _features_kept(directory: Path) -> str:
    """What a feature pass stopped by a full disk kept, and what to do."""
    return (
        f"the features of the documents finished so far are kept in {directory}: free some space there and "
        "rerun the same command, which goes on from them"
    )


def start_from(head: EagleHead, init_head: Path, target_config) -> None:
    """Copy into head the weights and scored tokens of the EAGLE-3 head in init_head, refused by
    name where its shape or the target layers it reads differ from head's."""
    saved = load_head(init_head, target_config, torch.float32)
    mismatch = head_mismatch(saved, head, "this run")
    if saved.feature_layers != head.feature_layers:
        raise ValueError(
            f"--init-head {init_head} {mismatch}: give --feature-layers {','.join(map(str, saved.feature_layers))}"
        )
    if mismatch is not None:
        raise ValueError(
            f"--init-head {init_head} {mismatch}; give the flags it was "
            "trained with (--output-vocab, --head-intermediate; its README.md says them)"
        )
    head.load_state_dict(saved.state_dict())


def eagle3_task(
    head: EagleHead,
    target: LoadedModel,
    train: FeatureArrays,
    held_out: FeatureArrays,
    config: TrainConfig,
    eagle3: Eagle3Config,
    identity: dict,
) -> Task:
    """The head's Task for the shared loop: random windows of the stored training features, the
    TTT loss, the held-out evaluation over the first eval_tokens of the held-out windows."""
    device, context = torch.device(config.device), eagle3.context
    with torch.no_grad():
        output_layer = head.output_layer(target.model.lm_head).to(device, torch.float32)  # frozen [S, H] rows
    scored_index = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    scored = head.output_token_ids if head.config.output_vocab_size else target_scored_ids(target.model)
    scored_index[scored.cpu()] = torch.arange(len(scored))
    scored_index = scored_index.to(device)
    embed = target.model.embed_tokens
    last_start = train.num_tokens - context

    def next_batch(generator: torch.Generator) -> FeatureArrays:
        starts = torch.randint(last_start + 1, (config.batch_size,), generator=generator).tolist()
        return train.windows(starts, context).to(device)

    def loss(model: EagleHead, batch: FeatureArrays) -> torch.Tensor:
        return ttt_loss(model, embed, output_layer, batch, scored_index, eagle3)[0]

    held_starts = list(range(0, held_out.num_tokens - context + 1, context))[: max(1, config.eval_tokens // context)]

    def evaluate(model: EagleHead) -> dict[str, float]:
        sums = [[0.0, 0.0] for _ in range(eagle3.ttt_steps)]
        for first in range(0, len(held_starts), config.batch_size):
            batch = held_out.windows(held_starts[first : first + config.batch_size], context).to(device)
            _, per_step = ttt_loss(model, embed, output_layer, batch, scored_index, eagle3)
            for step, (step_loss_value, agreement) in enumerate(per_step):
                sums[step][0] += step_loss_value
                sums[step][1] += agreement
        batches = -(-len(held_starts) // config.batch_size)
        agreements = [s[1] / batches for s in sums]
        metrics = {f"held_out_agreement_{j}": round(a, 4) for j, a in enumerate(agreements)}
        metrics |= {f"held_out_loss_{j}": round(s[0] / batches, 4) for j, s in enumerate(sums)}
        metrics["held_out_greedy_agreement"] = agreements[0]
        metrics["held_out_tau_estimate"] = round(tau_estimate(agreements), 3)
        return metrics

    return Task(head, next_batch, loss, evaluate, config.batch_size * context, identity)


def target_scored_ids(model) -> torch.Tensor:
    """The token ids the target's output layer scores, one per row [S] (ascending): its reduced
    output layer's, or the whole vocabulary's."""
    if model.config.output_vocab_size:
        return model.output_token_ids.cpu()
    return torch.arange(model.config.vocab_size)


def write_eagle3_card(directory: Path, record: dict, name: str) -> None:
    """README.md beside a finished EAGLE-3 head."""
    head = json.loads((directory / HEAD_CONFIG).read_text())
    model, e3, train = head["model"], record["eagle3"], record["train_config"]
    first, last = record["evaluations"][0], record["evaluations"][-1]
    steps = e3["ttt_steps"]
    agreements = " / ".join(f"{last.get(f'held_out_agreement_{j}', float('nan')):.3f}" for j in range(steps))
    weight_mb = (directory / HEAD_WEIGHTS).stat().st_size / 1e6
    arguments = record.get("arguments") or {}
    scored = record.get("scored_tokens") or model["output_vocab_size"] or model["vocab_size"]
    lines = [
        f"# {name}",
        "",
        f"An EAGLE-3 draft head for `{record['target']}`, trained by `specdec train-heads --eagle3` on the "
        "target's own answers (`specdec chat-data`), over its features stored once.",
        "",
        "| | |",
        "|---|---|",
        f"| head | fuse {len(record['feature_layers'])} target layers {record['feature_layers']} → "
        f"{model['hidden_size']}; fc {2 * model['hidden_size']} → {model['hidden_size']}; 1 decoder layer (MLP "
        f"{model['intermediate_size']}); scores {scored:,} tokens "
        f"through the target's output layer; {record['head_parameters'] / 1e6:.2f}M parameters |",
        f"| weights | {head.get('torch_dtype', '?')} safetensors, {weight_mb:.1f} MB |",
        f"| data | {record['data']}: {record['training_tokens']:,} training tokens"
        + (f" ({record['text_tokens']:,} of them from {record['text']})" if record.get("text") else "")
        + f", {record['held_out_tokens']:,} held out |",
        f"| loss | cross-entropy against the target's top-{e3['top_k']} distribution over {steps} training-time "
        f"test steps, weighted {e3['step_decay']:g}^j |",
        f"| training | {record['step']:,} steps of {train['batch_size'] * train['grad_accum']} windows of "
        f"{e3['context']} tokens; {record['tokens_seen']:,} tokens; AdamW lr {train['lr']:g} |",
        f"| time and hardware | {record['seconds'] / 3600:.2f} h on {record.get('cpu') or cpu_model()} |",
        f"| held-out | agreement by step {agreements}; tau estimate {first.get('held_out_tau_estimate', 0):.2f} → "
        f"{last.get('held_out_tau_estimate', 0):.2f} |",
        "",
        "## Use",
        "",
        "```",
        f"specdec generate {record['target']} --draft {arguments.get('out', name)} --prompt 'def f(x):'",
        "```",
        "",
        "## Made by",
        "",
        "```",
        command_line("train-heads", arguments, positional=("target",)),
        "```",
        "",
    ]
    (directory / "README.md").write_text("\n".join(lines))
