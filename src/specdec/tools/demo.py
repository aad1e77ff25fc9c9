"""`make demo`: speculative decoding of a code prompt, with the speedup over the target alone.

It uses the code-model pair shipped in models/ (code-target and its distilled code-draft,
trained by `specdec train` / `specdec distill` on the standard library): the completion is
printed with the accepted draft tokens in color, then the metrics, then the target alone on
the same prompt and the measured speedup; last, the speedup with prompt lookup in front of
the draft model (`specdec generate --lookup`).

When SmolLM2-135M-Instruct is in the cache (`make smollm2`) and its shipped draft
(models/smollm2-draft) is there, a chat with that real pair follows; without them the demo
says how to get them and needs no download.

Without the shipped pair (a checkout that lacks models/), it falls back to a stand-in it
builds once under build/demo-stand-in/: a random-init ~100M-parameter Llama with a tokenizer
trained on the standard library, drafted by prompt lookup. A random model writes nonsense,
but exactly the nonsense the target alone would write.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch

from specdec.paths import BUILD, ROOT, SHIPPED_DRAFT, SHIPPED_TARGET, SMOLLM2_DRAFT, SMOLLM2_TARGET

DEMO_DIR = BUILD / "demo-stand-in"
PROMPT = '''def parse_header(line):
    """Split a 'Key: value' header line."""
    key, _, value = line.partition(":")
    return key.strip(), value.strip()


def parse_headers(lines):'''


def build_stand_in(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    from specdec.models.tokenizer import train_byte_level_bpe
    from specdec.output_dir import open_output_dir

    print(f"building a random-init stand-in target in {path} (once) ...", flush=True)
    with open_output_dir(path, "demo", resumable=False) as output:  # an interrupted build leaves nothing that loads
        output.clear_staging()
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(stdlib.glob("*.py"))[:200]
        tokenizer = train_byte_level_bpe((f.read_text(errors="replace") for f in files), vocab_size=32000)
        save_random_llama(
            output.staging,
            vocab_size=tokenizer.get_vocab_size(),
            hidden_size=768,
            intermediate_size=2048,
            num_layers=12,
            num_heads=12,
            num_kv_heads=4,
            seed=0,
        )
        tokenizer.save(str(output.staging / "tokenizer.json"))
        return output.commit()


def save_random_llama(
    path: Path,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    seed: int,
) -> None:
    """A random-init Llama (normal(0, 0.02) matrices) saved as a Hugging Face directory."""
    from specdec.models.checkpoint import save_pretrained
    from specdec.models.llama import LlamaModel, ModelConfig

    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaModel(config)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    save_pretrained(model, path, torch.bfloat16)


def print_lookup_then_draft_speedup(k: int, max_tokens: int) -> None:
    """The same prompt with prompt lookup first and the draft model where it finds nothing
    (speculative_method="lookup_then_draft", `specdec generate --lookup`): one line of speed,
    each timed twice (interleaved), the faster kept."""
    from specdec import LLM, SamplingParams

    llm = LLM(
        str(SHIPPED_TARGET),
        speculative_model=str(SHIPPED_DRAFT),
        speculative_method="lookup_then_draft",
        num_speculative_tokens=k,
    )
    plain = llm.target_only()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for warming in (llm, plain):  # nothing one-off (compiling, allocating, first calls) in the timed runs
        warming.warm_up(PROMPT, params)
    runs = [(llm.generate(PROMPT, params)[0], plain.generate(PROMPT, params)[0]) for _ in range(2)]  # interleaved
    speculative = max((run[0] for run in runs), key=lambda out: out.metrics.tokens_per_second)
    alone = max((run[1] for run in runs), key=lambda out: out.metrics.tokens_per_second)
    rate, base = speculative.metrics.tokens_per_second, alone.metrics.tokens_per_second
    print(
        f"\nprompt lookup first, the draft model where it finds nothing (--lookup), k={k}: {rate:.1f} tokens/s "
        f"against {base:.1f} for the target alone: speedup {rate / base:.2f}x; greedy outputs identical: "
        f"{speculative.outputs[0].token_ids == alone.outputs[0].token_ids}"
    )


CHAT = (
    "Edit this function so that it raises ValueError when the line has no colon:\n\n```python\n"
    + PROMPT.split("\n\n\n")[0]
    + "\n```"
)


def chat_with_smollm2() -> int:
    """The real pair, SmolLM2-135M-Instruct and its distilled draft, on an "edit this function"
    chat, if both are here; otherwise a line on how to get them (no download here)."""
    from specdec.cli import main as cli_main

    if not (SMOLLM2_DRAFT / "config.json").is_file():
        return 0  # not shipped in this checkout
    if not (SMOLLM2_TARGET / "config.json").is_file():
        print(
            "\n(a real chat model, SmolLM2-135M-Instruct, with its distilled draft in models/: `make smollm2` "
            "fetches the model, ~100 MB, and `make demo` then chats with it)"
        )
        return 0
    print(
        f"\nSmolLM2-135M-Instruct ({SMOLLM2_TARGET}), draft {SMOLLM2_DRAFT.relative_to(ROOT)}, prompt lookup "
        "first, greedy\n"
    )
    return cli_main(
        [
            "generate",
            "--model",
            str(SMOLLM2_TARGET),
            "--draft",
            str(SMOLLM2_DRAFT),
            "--lookup",
            "--chat",
            CHAT,
            "--max-tokens",
            "160",
            "--compare",
            "--color",
            "always",
        ]
    )


def main() -> int:
    from specdec.cli import main as cli_main

    common = ["-k", "4", "--prompt", PROMPT, "--max-tokens", "128", "--compare", "--color", "always"]
    if (SHIPPED_TARGET / "config.json").is_file() and (SHIPPED_DRAFT / "config.json").is_file():
        print(f"target {SHIPPED_TARGET.relative_to(ROOT)}, draft {SHIPPED_DRAFT.relative_to(ROOT)}, greedy\n")
        status = cli_main(["generate", "--model", str(SHIPPED_TARGET), "--draft", str(SHIPPED_DRAFT)] + common)
        if status == 0:
            print_lookup_then_draft_speedup(k=4, max_tokens=128)
            status = chat_with_smollm2()
        return status
    target = build_stand_in(DEMO_DIR)
    print("no shipped pair in models/: a random-init stand-in target, drafted by prompt lookup\n")
    return cli_main(["generate", "--model", str(target), "--ngram", "--dtype", "float32"] + common)


if __name__ == "__main__":
    sys.exit(main())
