import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import helpers.py

# The test models are tiny: a second thread buys nothing, and on a busy 2-core machine
# threads that wait on each other make the suite several times slower.
torch.set_num_threads(1)
