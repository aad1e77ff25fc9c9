import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import helpers.py

# The test models are tiny: a second thread buys nothing, and on a busy 2-core machine
# threads that wait on each other make the suite several times slower.
torch.set_num_threads(1)

# GGUF files the tests write are packed into a cache of their own, not the user's
os.environ["SPECDEC_PACKED_CACHE"] = _PACKED = tempfile.mkdtemp(prefix="specdec-packed-")
atexit.register(shutil.rmtree, _PACKED, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict[str, Path]:
    """The suite's shared tiny pair (helpers.save_tiny_pair): a random llama target (2 layers)
    and a random qwen2 draft (1 layer) sharing a tokenizer, {"target": dir, "draft": dir}; made
    once per session. Modules that need other models (other architectures, a trained head, a
    draft that agrees with the target) make their own."""
    from helpers import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"), target_seed=1, draft_seed=2)
