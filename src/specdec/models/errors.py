"""The error a model that cannot be loaded raises (models/loader.py, models/gguf.py and the
modules they use), and the bounds of a config's sizes both check, in a module of its own so that
each can use them without importing the other."""


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message says why and what to do."""


# config.json's size fields -> the largest value accepted: far above any real model's (the
# largest have 126 layers, 128 heads, 16,384 wide, 53,248-wide MLPs, 262,144 tokens and
# 10,485,760 positions), so that a corrupt or hostile config is refused by name before anything
# of its size is allocated (a billion layers would otherwise exhaust the memory building a list)
CONFIG_BOUNDS = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1 << 13,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 24,
    "output_vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 24,
    "sliding_window": 1 << 24,
}


def size_out_of_bounds(
    field: str, value: int, where: str, named: str | None = None, remedy: str | None = None
) -> str | None:
    """What to say of a size past its bound in CONFIG_BOUNDS (None if it is within it). field: the
    config.json name; named: what the source calls it, if not that (a GGUF metadata key, a field
    of an EAGLE head's head.json); remedy: what to say after the bound, if not that a model's
    config or file is corrupt (an EAGLE head's head.json)."""
    bound = CONFIG_BOUNDS[field]
    if value <= bound:
        return None
    if named is None:
        what, source, fix = field, "config", "fix the value or re-download the model"
    else:
        what, source, fix = f"{named} ({field})", "file", "download or convert the file again"
    if remedy is None:
        remedy = f"the {source} is corrupt or not a model's: {fix}"
    return (
        f"{where}: {what} is {value}, more than {bound}, the most specdec accepts (far above any "
        f"real model's); {remedy}"
    )
