"""A cache of GGUF files read quantized: the packed tensors in one flat file, mapped into
memory on every load, and the GGUF file's configuration and tokenizer beside it as JSON.

The first load of a GGUF file parses its metadata (gguf.GGUFReader: seconds for a 150k-token
vocabulary) and packs every quantized matrix (gguf_quants.pack). Each packed tensor is written
to SPECDEC_CACHE/packed/<file>-<key>.bin as soon as it is made and then dropped, so a load never
holds the packed model in its own memory, and the next load of the same file skips the GGUF file
altogether. A load reads the matrices that every step streams whole into one block of anonymous
memory in 2 MB pages (where the kernel grants them), and maps the rest of the file (copy-on-write,
never written): an embedding table that is only gathered from (most of its rows never become
resident), the norms. Why not map the matrices too: streamed from mapped 4 KB pages of the page
cache, each page is a TLB miss and a fresh start for the hardware prefetcher (docs/runner.md has
the decode steps measured both ways). The key covers
the file's path, size and modification time and the packing code itself, so a changed file or
a new layout is packed again. Files are written under temporary names; the JSON index, written
last, marks a complete entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from pathlib import Path

import numpy as np
import torch

from specdec.models import gguf_quants
from specdec.models.gguf_quants import LAYOUTS, PackedTensor

log = logging.getLogger("specdec")

FIELDS = ("codes", "sc", "mn", "d", "dmin")
ALIGN = 64  # every tensor starts at a multiple of this many bytes
DTYPES = {"uint8": torch.uint8, "float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def cache_dir() -> Path:
    """SPECDEC_PACKED_CACHE, else SPECDEC_CACHE/packed (read at each call: tests move it)."""
    from specdec.paths import CACHE

    return Path(os.environ.get("SPECDEC_PACKED_CACHE") or CACHE / "packed").expanduser()


def entry(path: Path) -> tuple[Path, Path, str]:
    """(the data file, the JSON index, the key) of path's cache entry."""
    stat = path.stat()
    code = Path(gguf_quants.__file__).read_bytes()  # the layout: a change to it is a new key
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|".encode() + code).hexdigest()[:16]
    base = f"{path.stem}-{key}"
    return cache_dir() / f"{base}.bin", cache_dir() / f"{base}.json", key


class Writer:
    """Writes one entry: tensors as they come (add), then the index (finish)."""

    def __init__(self, path: Path):
        self.source = path
        self.data_path, self.index_path, self.key = entry(path)
        cache_dir().mkdir(parents=True, exist_ok=True)
        self.partial = self.data_path.with_name(f"{self.data_path.name}.{os.getpid()}.part")  # one per process
        self.file = open(self.partial, "wb")
        self.tensors: dict[str, list] = {}  # stored name -> [dtype, shape, offset]
        self.packed: dict[str, list] = {}  # Hugging Face name -> [kind, rows, cols]
        self.weights: list[str] = []

    def add(self, name: str, tensor) -> None:
        """A float tensor or a PackedTensor, under its Hugging Face name."""
        if isinstance(tensor, PackedTensor):
            self.packed[name] = [tensor.kind, tensor.rows, tensor.cols]
            for field in FIELDS:
                if getattr(tensor, field) is not None:
                    self._write(f"packed/{name}/{field}", getattr(tensor, field))
        else:
            self.weights.append(name)
            self._write(f"weights/{name}", tensor)

    def _write(self, stored: str, tensor: torch.Tensor) -> None:
        offset = self.file.tell()
        self.file.write(b"\0" * (-offset % ALIGN))
        offset = self.file.tell()
        # numpy's stubs give ndarray the buffer protocol only from Python 3.12
        self.file.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()))  # pyright: ignore[reportArgumentType]
        self.tensors[stored] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset]

    def finish(self, info: dict) -> None:
        self.file.close()
        self.partial.replace(self.data_path)
        _remove_older_entries(self.source, keep=self.index_path)
        index = {
            **info,
            "key": self.key,
            "source": str(self.source.resolve()),
            "tensors": self.tensors,
            "packed": self.packed,
            "weights": self.weights,
        }
        partial = self.index_path.with_name(f"{self.index_path.name}.{os.getpid()}.part")
        partial.write_text(json.dumps(index))
        partial.replace(self.index_path)

    def abandon(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


def load_index(path: Path) -> dict | None:
    """The index of path's entry (its config, tokenizer and tensors' places), no tensor read;
    None if there is no complete entry for the file as it is now."""
    data_path, index_path, key = entry(path)
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        return None
    if index.get("key") != key or not data_path.is_file():
        return None
    return index


def load(path: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, PackedTensor]] | None:
    """(the index, float weights, packed tensors) of path's entry, mapped from the cache; None
    if there is no complete entry for the file as it is now."""
    index = load_index(path)
    if index is None:
        return None
    data_path, _, _ = entry(path)
    try:
        data = np.memmap(data_path, dtype=np.uint8, mode="c")  # copy-on-write: never written back
        streamed = _streamed(index)
        tensors = {
            name: _view(data, dtype, shape, offset)
            for name, (dtype, shape, offset) in index["tensors"].items()
            if name not in streamed
        }
        tensors.update(_read_into_memory(data_path, {name: index["tensors"][name] for name in streamed}))
        packed = {  # codes and d are always stored; sc, mn, dmin by kind
            name: PackedTensor(
                kind,
                LAYOUTS[kind],
                rows,
                cols,
                *(tensors.get(f"packed/{name}/{field}") for field in FIELDS),  # pyright: ignore[reportArgumentType]
            )
            for name, (kind, rows, cols) in index["packed"].items()
        }
        weights = {name: tensors[f"weights/{name}"] for name in index["weights"]}
    except (KeyError, ValueError, TypeError) as e:  # a cut or damaged entry: read the GGUF file again
        log.warning("the packed cache of %s is damaged (%s); reading the file again", path, e)
        return None
    return index, weights, packed


def _nbytes(dtype: str, shape: list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * torch.tensor([], dtype=DTYPES[dtype]).element_size()


def _view(data: np.memmap, dtype: str, shape: list[int], offset: int) -> torch.Tensor:
    nbytes = _nbytes(dtype, shape)
    if offset + nbytes > data.size:
        raise ValueError("the data file is shorter than its index says")
    return torch.from_numpy(data[offset : offset + nbytes]).view(DTYPES[dtype]).view(shape)


def _streamed(index: dict) -> set[str]:
    """The stored tensors of the packed matrices every step reads whole: all but an input
    embedding that has an output layer of its own (only its gathered rows are read)."""
    names = set(index["packed"])
    if "lm_head.weight" in names:
        names -= {name for name in names if name.endswith("embed_tokens.weight")}
    return {f"packed/{name}/{field}" for name in names for field in FIELDS} & set(index["tensors"])


HUGE_PAGE = 2 << 20


def _read_into_memory(data_path: Path, entries: dict[str, list]) -> dict[str, torch.Tensor]:
    """entries (stored name -> [dtype, shape, offset in the file]) read from the file into one
    block of anonymous memory, asked for in 2 MB pages (madvise; Linux grants them where
    transparent huge pages are "always" or "madvise"). Read, not copied from a mapping, so the
    file's pages never count as this process's memory."""
    if not entries:
        return {}
    sizes = {name: _nbytes(dtype, shape) for name, (dtype, shape, _) in entries.items()}
    total = sum(-(-size // ALIGN) * ALIGN for size in sizes.values())
    block = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        block.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(block, dtype=torch.uint8)  # holds block alive: every tensor below is a view
    start = -memory.data_ptr() % HUGE_PAGE  # the first whole 2 MB page
    tensors, view = {}, memoryview(block)
    with open(data_path, "rb") as f:
        for name, (dtype, shape, offset) in sorted(entries.items(), key=lambda item: item[1][2]):
            size = sizes[name]
            f.seek(offset)
            if f.readinto(view[start : start + size]) != size:
                raise ValueError("the data file is shorter than its index says")
            tensors[name] = memory[start : start + size].view(DTYPES[dtype]).view(shape)
            start += -(-size // ALIGN) * ALIGN
    view.release()
    return tensors


def _remove_older_entries(path: Path, keep: Path) -> None:
    """Earlier entries of the same file (another key: the file or the layout changed)."""
    for old in cache_dir().glob(f"{path.stem}-*.json"):
        if old == keep:
            continue
        try:
            if json.loads(old.read_text()).get("source") == str(path.resolve()):
                old.with_name(old.name.removesuffix(".json") + ".bin").unlink(missing_ok=True)
                old.unlink(missing_ok=True)
        except (OSError, ValueError):
            continue
