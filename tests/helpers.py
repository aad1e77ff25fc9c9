"""Tiny random models saved with transformers' save_pretrained: the outside reference."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "llama3", "mistral", "qwen2", "qwen3")

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i, add(i, i))\n"
) * 4


# Small standard-library files present in Python 3.10-3.13, none of them held out.
CORPUS_FILES = (
    "abc.py",
    "copy.py",
    "genericpath.py",
    "keyword.py",
    "numbers.py",
    "opcode.py",
    "operator.py",
    "stat.py",
    "string.py",
    "types.py",
)


def stdlib_corpus(path: Path, names: tuple[str, ...] = CORPUS_FILES) -> Path:
    """A corpus directory at path: copies of these standard-library files."""
    import shutil
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(stdlib / name, path / name)
    return path


def make_tokenizer(vocab_size: int, text: str = TEXT):
    """A byte-level BPE trained on text (a little Python by default), with at most vocab_size
    tokens (fewer when the text has fewer merges to learn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def hf_config(arch: str, vocab_size: int = 320, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        cls = LlamaConfig
    elif arch == "llama3":
        cls = LlamaConfig
        common.update(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
            attention_bias=True,
        )
    elif arch == "mistral":
        cls = MistralConfig
        common.update(sliding_window=16)
    elif arch == "qwen2":
        cls = Qwen2Config
    elif arch == "qwen3":
        cls = Qwen3Config
        common.update(head_dim=32)
    else:
        raise ValueError(arch)
    common.update(overrides)
    return cls(**common)


def save_tiny_model(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 320,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
    init_std: float = 0.02,
    **overrides,
) -> Path:
    """Random-init a transformers model and save it (safetensors) with a tokenizer."""
    from transformers import AutoModelForCausalLM

    config = hf_config(arch, vocab_size, initializer_range=init_std, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        make_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def save_tiny_pair(
    root: Path, target_seed: int, draft_seed: int, draft_arch: str = "qwen2", **overrides
) -> dict[str, Path]:
    """A tiny random target (llama, 2 layers) and draft (draft_arch, 1 layer) sharing the
    tokenizer, saved under root: {"target": dir, "draft": dir}; overrides: config fields of both
    (max_position_embeddings, ...)."""
    return {
        "target": save_tiny_model(root / "target", "llama", seed=target_seed, init_std=0.3, **overrides),
        "draft": save_tiny_model(
            root / "draft", draft_arch, seed=draft_seed, init_std=0.3, num_hidden_layers=1, **overrides
        ),
    }


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_random_head(
    target_dir: Path, out: Path, seed: int = 0, feature_layers: tuple[int, ...] = (), output_vocab: int = 0
) -> Path:
    """An untrained EAGLE head (default init, seeded) for the model in target_dir, saved in float32;
    feature_layers: an EAGLE-3 head reading those layers; output_vocab: scoring that many tokens
    (ids 0..output_vocab-1)."""
    from specdec.models.eagle import EagleHead, head_config, save_head
    from specdec.models.loader import load_pretrained

    target_config = load_pretrained(target_dir, "float32", load_tokenizer=False).model.config
    torch.manual_seed(seed)
    head = EagleHead(head_config(target_config, output_vocab), feature_layers)
    return save_head(head, out, torch.float32, target=str(target_dir))


def save_tree_models(root: Path) -> dict[str, Path]:
    """A tiny target, a draft that is the target plus noise (it agrees with the target often, not
    always: trees then accept branches through second children) and an untrained head, under root."""
    target = save_tiny_model(root / "target", "llama", seed=3, init_std=0.3)
    draft = load_hf(target)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.1 * param.std().clamp(min=0.1))
    draft.save_pretrained(root / "draft")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "draft" / name).write_bytes((target / name).read_bytes())
    return {"target": target, "draft": root / "draft", "head": save_random_head(target, root / "head", seed=5)}


def random_prompts(
    n: int, seed: int, lengths: tuple[int, int] = (2, 25), vocab: int = 320, repeat: bool = False
) -> list[list[int]]:
    """n fresh random token prompts (ids 2..vocab-1) of lengths drawn from [lengths[0], lengths[1]);
    `repeat` tiles each three times, so that prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1], (1,), generator=g))
        tokens = torch.randint(2, vocab, (length,), generator=g).tolist()
        prompts.append(tokens * 3 if repeat else tokens)
    return prompts


def token_ids(outputs) -> list[list[int]]:
    """The generated token ids of each RequestOutput."""
    return [o.outputs[0].token_ids for o in outputs]


class HealthWatch:
    """While open (a context manager), a thread asks url's /health every 20 ms: the statuses it
    got, in order, and its slowest answer in seconds (a server that stalls its event loop answers
    late)."""

    def __init__(self, url: str, timeout: float = 120):
        import threading

        self.url, self.timeout, self.statuses, self.slowest = url, timeout, [], 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def _watch(self) -> None:
        import time

        import httpx

        while not self._done.is_set():
            start = time.monotonic()
            self.statuses.append(httpx.get(f"{self.url}/health", timeout=self.timeout).status_code)
            self.slowest = max(self.slowest, time.monotonic() - start)
            self._done.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def assert_drains(url: str, api_key: str, model: str) -> None:
    """A server sent SIGTERM with requests in flight drains: once /health says 503, a new
    request (official client) is a 503 shutting_down in OpenAI's shape with Retry-After, and
    /metrics is still answered (where it used to refuse the connection)."""
    import time

    import httpx
    import openai
    import pytest

    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=model, prompt="def", max_tokens=2)
    assert refused.value.status_code == 503 and refused.value.code == "shutting_down"
    assert int(refused.value.response.headers["Retry-After"]) >= 1
    assert httpx.get(f"{url}/metrics").status_code == 200


def fake_sharegpt(num: int, seed: int, cut: bool = True) -> tuple[str, list[dict]]:
    """A ShareGPT-shaped JSON array of num conversations (some not started by a person, some
    blank, some too long, unicode and escapes inside), written as the package writes it, and
    cut short inside one more entry's string where cut."""
    rng = random.Random(seed)
    entries = []
    for i in range(num):
        first = rng.choice(["human", "human", "human", "gpt"])
        message = rng.choice(["", "   ", "x" * 3000, f'question {i}: "quoted", naïve café 字 \\ {rng.random()}'])
        turns = [{"from": first, "value": message}, {"from": "gpt", "value": "answer [1], {2}"}]
        entries.append({"id": f"conv{i}_{rng.randrange(10**6)}", "conversations": turns})
    text = json.dumps(entries, indent=2, ensure_ascii=False)
    if cut:
        extra = json.dumps({"id": "cut", "conversations": [{"from": "human", "value": "never finished"}]}, indent=2)
        text = text[:-2] + ",\n  " + extra[: extra.index("never") + 5]  # ends inside a string, as the real file does
    return text, entries
