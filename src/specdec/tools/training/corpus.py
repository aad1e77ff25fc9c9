"""The text a model learns from: documents, held-out documents, token streams, windows.

Terms:
  document     one text file of the corpus (its relative path is its name)
  held-out     documents never trained on, only evaluated on
  token stream all documents of a split tokenized and joined into one flat 1-D tensor, each
               document followed by the end-of-text token (so the model learns where files end)
  window       T + 1 consecutive tokens of a stream: the model reads the first T and predicts
               the last T

The default corpus is the Python standard library of the running interpreter: every *.py
file under sysconfig's stdlib path, except site-packages, test directories (EXCLUDED_DIRECTORIES)
and files that are not UTF-8. HELD_OUT_MODULES are held out. Any other directory (all its text
files, recursively, hidden ones skipped) or a single text file works as a corpus too; there the
held-out documents are those under a top-level held_out/ directory if it has one (as
`specdec chat-data` writes), else those of HELD_OUT_MODULES if the directory has any and
other files too (a copy of the standard library), else every tenth file in sorted order (the
last file when there are fewer than ten), and a single file holds out its last tenth (cut at
a line break).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

END_OF_TEXT = "<|endoftext|>"

# Standard-library modules held out for evaluation: never trained on. All exist, unchanged in
# name, in Python 3.10 to 3.13; together about 200 KB of code: algorithms (bisect, heapq,
# graphlib, fractions), text handling (textwrap, shlex, fnmatch, glob, pprint, reprlib),
# small applications (calendar, getopt, netrc, sched, queue) and numeric helpers (colorsys).
HELD_OUT_MODULES = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "fnmatch.py",
    "fractions.py",
    "getopt.py",
    "glob.py",
    "graphlib.py",
    "heapq.py",
    "netrc.py",
    "pprint.py",
    "queue.py",
    "reprlib.py",
    "sched.py",
    "shlex.py",
    "textwrap.py",
)
# Directories of the standard library that are not trained on: installed packages and tests.
EXCLUDED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
HELD_OUT_DIRECTORY = "held_out"  # a corpus directory's documents under it are held out
HELD_OUT_EVERY = 10  # outside the standard library: every tenth document is held out


@dataclass(frozen=True)
class Document:
    name: str  # path relative to the corpus root (the file name for a one-file corpus)
    text: str


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Document, ...]
    held_out: tuple[Document, ...]
    skipped: tuple[str, ...] = ()  # files of a directory corpus left out as not text

    def describe(self) -> str:
        chars = sum(len(d.text) for d in self.train)
        line = (
            f"corpus {self.root}: {len(self.train)} training documents ({chars / 1e6:.2f}M characters), "
            f"{len(self.held_out)} held out ({', '.join(d.name for d in self.held_out[:6])}"
            f"{', ...' if len(self.held_out) > 6 else ''})"
        )
        return line + (f"; {len(self.skipped)} files skipped as not text" if self.skipped else "")


def stdlib_path() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(path: str | Path | None = None) -> Corpus:
    """The corpus at `path` (a directory or a text file); None = the standard library."""
    if path is None:
        root = stdlib_path()
        documents, skipped = _read_directory(root, _stdlib_files(root))
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise ValueError(
                f"corpus {str(root)!r} does not exist; give a text file or a directory of text "
                "files (or no --corpus for the Python standard library)"
            )
        if root.is_file():
            documents, skipped = [Document(root.name, _read_text_file(root))], []
        else:
            documents, skipped = _read_directory(root, _all_files(root))
    documents = [d for d in documents if d.text.strip()]
    if not documents:
        found = f" ({len(skipped)} files skipped as binary or not UTF-8)" if skipped else ""
        raise ValueError(
            f"corpus {str(root)!r} is empty: it holds no non-blank text{found}; "
            "give a text file or a directory holding text files"
        )
    train, held_out = split_held_out(documents)
    return Corpus(root, tuple(train), tuple(held_out), tuple(skipped))


def split_held_out(documents: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by the rules in the module docstring."""
    in_held_out_dir = [d.name.startswith(HELD_OUT_DIRECTORY + "/") for d in documents]
    if any(in_held_out_dir) and not all(in_held_out_dir):
        return (
            [d for d, held in zip(documents, in_held_out_dir) if not held],
            [d for d, held in zip(documents, in_held_out_dir) if held],
        )
    held_names = set(HELD_OUT_MODULES)
    named_held_out = [d.name in held_names for d in documents]
    if any(named_held_out) and not all(named_held_out):  # all of them: nothing would be left to train on
        return ([d for d in documents if d.name not in held_names], [d for d in documents if d.name in held_names])
    if len(documents) == 1:
        return _split_one(documents[0])
    held = set(range(HELD_OUT_EVERY - 1, len(documents), HELD_OUT_EVERY)) or {len(documents) - 1}
    return ([d for i, d in enumerate(documents) if i not in held], [d for i, d in enumerate(documents) if i in held])


def _split_one(document: Document) -> tuple[list[Document], list[Document]]:
    """One document: its last tenth (from a line start) is held out."""
    text = document.text
    cut = text.rfind("\n", 0, len(text) * (HELD_OUT_EVERY - 1) // HELD_OUT_EVERY) + 1
    if cut <= 0 or not text[:cut].strip() or not text[cut:].strip():
        cut = len(text) * (HELD_OUT_EVERY - 1) // HELD_OUT_EVERY
    return [Document(document.name, text[:cut])], [Document(document.name + " (last tenth)", text[cut:])]


def _stdlib_files(root: Path) -> list[Path]:
    return sorted(
        f for f in root.rglob("*.py") if f.is_file() and not EXCLUDED_DIRECTORIES & set(f.relative_to(root).parts[:-1])
    )


def _all_files(root: Path) -> list[Path]:
    return sorted(
        f
        for f in root.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts)
    )


def _read_directory(root: Path, files: list[Path]) -> tuple[list[Document], list[str]]:
    """Documents for the text files; names of the others (binary, not UTF-8)."""
    documents, skipped = [], []
    for file in files:
        text = _decode(file.read_bytes())
        if text is None:
            skipped.append(file.relative_to(root).as_posix())
        else:
            documents.append(Document(file.relative_to(root).as_posix(), text))
    return documents, skipped


def _read_text_file(file: Path) -> str:
    text = _decode(file.read_bytes())
    if text is None:
        raise ValueError(
            f"corpus file {str(file)!r} is not text (binary or not UTF-8); "
            "give a UTF-8 text file or a directory of them"
        )
    return text


def _decode(data: bytes) -> str | None:
    """The UTF-8 text of a file, or None if it is binary (holds NUL bytes) or not UTF-8."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def token_stream(documents: tuple[Document, ...] | list[Document], tokenizer, end_of_text_id: int) -> torch.Tensor:
    """Documents -> one flat int32 tensor [N]: doc_1 EOT doc_2 EOT ... doc_n EOT.
    tokenizer: a `tokenizers.Tokenizer` (encode_batch runs in parallel)."""
    encodings = tokenizer.encode_batch([d.text for d in documents], add_special_tokens=False)
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(end_of_text_id)
    return torch.tensor(ids, dtype=torch.int32)


def check_stream_length(stream: torch.Tensor, window: int, what: str, batch_size: int = 1) -> None:
    """The text must hold one window of window + 1 tokens, and a micro-batch of batch_size
    windows must not exceed the whole text (it would only repeat it, at the memory's expense)."""
    if len(stream) < window + 1:
        raise ValueError(
            f"the {what} text is only {len(stream)} tokens, fewer than one window of "
            f"{window + 1} (context + 1); use a shorter --context or a larger corpus"
        )
    if batch_size * (window + 1) > len(stream):
        raise ValueError(
            f"--batch-size {batch_size} windows of {window + 1} tokens (context + 1) is "
            f"{batch_size * (window + 1):,} tokens a micro-batch, more than the {len(stream):,} tokens of "
            f"{what} text; give --batch-size {len(stream) // (window + 1)} or less (or more text)"
        )


def sample_windows(stream: torch.Tensor, batch_size: int, window: int, generator: torch.Generator) -> torch.Tensor:
    """batch_size windows of window + 1 tokens at uniformly random starts: [B, window + 1] int64."""
    starts = torch.randint(0, len(stream) - window, (batch_size,), generator=generator)  # [B]
    offsets = torch.arange(window + 1)  # [window + 1]
    return stream[starts[:, None] + offsets].long()  # [B, 1] + [window + 1] -> [B, window + 1]


def evaluation_windows(stream: torch.Tensor, window: int, max_tokens: int) -> torch.Tensor:
    """Consecutive, non-overlapping windows from the start of the stream, covering at most
    max_tokens predicted tokens: [N, window + 1] int64, N >= 1. A stream shorter than one
    window gives one shorter window of all of it."""
    window = min(window, len(stream) - 1)
    count = max(1, min((len(stream) - 1) // window, max_tokens // window))
    starts = torch.arange(count) * window  # [N]
    return stream[starts[:, None] + torch.arange(window + 1)].long()  # [N, window + 1]
