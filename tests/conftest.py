import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import helpers.py

# The test models are tiny: a second thread buys nothing, and on a busy 2-core machine
# threads that wait on each other make the suite several times slower.
torch.set_num_threads(1)

# GGUF files the tests write are packed into a cache of their own, not the user's
os.environ["SPECDEC_PACKED_CACHE"] = _PACKED = tempfile.mkdtemp(prefix="specdec-packed-")
atexit.register(shutil.rmtree, _PACKED, ignore_errors=True)
