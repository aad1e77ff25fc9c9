"""worker/prefetch.py: the GGUF kernel's one-row prefetch, chosen by timing on the machine.

- Prefetching changes when bytes arrive, never a result: every type's one-row product is bit
  for bit the same with and without it.
- The choice takes prefetch only where its median weights pass is 3% faster; the timing
  interleaves the two settings and leaves the kernel's default set.
- SPECDEC_ONE_ROW_PREFETCH decides without timing (and a bad value is refused by name); a model
  too small to stream from memory leaves the choice to a later one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_files import encode
from specdec.kernels import qmatmul
from specdec.models.gguf_linear import GGUFLinear
from specdec.models.gguf_quants import LAYOUTS, pack
from specdec.worker import prefetch


@pytest.fixture(autouse=True)
def undecided(monkeypatch):
    """Each test starts with no process-wide choice, and leaves the kernel's default."""
    monkeypatch.setattr(prefetch, "_decided", None)
    monkeypatch.delenv(prefetch.ENV_VAR, raising=False)
    yield
    qmatmul().set_prefetch_rows(prefetch.DEFAULT_ROWS)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_one_row_prefetch_changes_no_result(kind):
    rng = np.random.default_rng(3)
    rows, cols = 256, 2048  # 0.3-2 MB of codes: the prefetches run well ahead of the reads
    data = encode(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, kind, rng)
    layer = GGUFLinear([pack(kind, data, rows, cols)])
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(4))
    results = {}
    for setting in (prefetch.ONE_ROW, prefetch.DEFAULT_ROWS):
        qmatmul().set_prefetch_rows(setting)
        assert qmatmul().prefetch_rows() == setting
        results[setting] = layer(x)
    assert torch.equal(results[prefetch.ONE_ROW], results[prefetch.DEFAULT_ROWS])


def test_the_kernel_refuses_fewer_than_one_row():
    with pytest.raises(RuntimeError, match="at least 1"):
        qmatmul().set_prefetch_rows(0)


@pytest.mark.parametrize(
    ("with_prefetch", "without", "expected"),
    [
        ([40e-3, 41e-3, 90e-3], [56e-3, 57e-3, 20e-3], True),  # medians 41 against 56 ms
        ([55e-3] * 3, [56e-3] * 3, False),  # 1.8% faster: within MIN_GAIN, keep the default
        ([60e-3] * 3, [56e-3] * 3, False),
    ],
)
def test_prefetch_only_where_its_median_is_min_gain_faster(with_prefetch, without, expected):
    assert prefetch.prefers_prefetch(with_prefetch, without) is expected


def test_timing_interleaves_the_settings_and_restores_the_default():
    state = {"rows": prefetch.DEFAULT_ROWS}
    passes = []

    def run_pass():
        passes.append(state["rows"])

    def set_rows(rows):
        state["rows"] = rows

    with_prefetch, without = prefetch.time_passes(run_pass, set_rows, rounds=3)
    assert passes == [prefetch.DEFAULT_ROWS] + [prefetch.ONE_ROW, prefetch.DEFAULT_ROWS] * 3  # a warm-up first
    assert len(with_prefetch) == len(without) == 3
    assert state["rows"] == prefetch.DEFAULT_ROWS


def test_the_environment_decides_without_timing(monkeypatch):
    model = torch.nn.Linear(4, 4)  # any model: the variable decides before anything is timed
    monkeypatch.setattr(prefetch, "time_passes", lambda *a, **k: pytest.fail("timed despite the variable"))
    monkeypatch.setenv(prefetch.ENV_VAR, "on")
    assert prefetch.choose_one_row_prefetch(model) is True
    assert qmatmul().prefetch_rows() == prefetch.ONE_ROW
    assert prefetch.choose_one_row_prefetch(model) is True  # decided once a process
    monkeypatch.setattr(prefetch, "_decided", None)
    monkeypatch.setenv(prefetch.ENV_VAR, "off")
    assert prefetch.choose_one_row_prefetch(model) is False
    assert qmatmul().prefetch_rows() == prefetch.DEFAULT_ROWS


def test_a_bad_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(prefetch.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="SPECDEC_ONE_ROW_PREFETCH must be 'on' or 'off'"):
        prefetch.choose_one_row_prefetch(torch.nn.Linear(4, 4))


def test_a_small_model_leaves_the_choice_to_a_later_one(monkeypatch):
    layer = GGUFLinear(
        [pack("Q4_0", encode(np.zeros((32, 256), np.float32), "Q4_0", np.random.default_rng(0)), 32, 256)]
    )
    model = torch.nn.Sequential(layer)
    assert prefetch.gguf_weight_bytes(model) < prefetch.MIN_TIMED_BYTES
    monkeypatch.setattr(prefetch, "time_passes", lambda *a, **k: pytest.fail("timed a model this small"))
    assert prefetch.choose_one_row_prefetch(model) is None
    assert prefetch._decided is None and qmatmul().prefetch_rows() == prefetch.DEFAULT_ROWS
    monkeypatch.setattr(prefetch, "MIN_TIMED_BYTES", 0)  # were it large enough: timed, and decided
    monkeypatch.setattr(prefetch, "time_passes", lambda *a, **k: ([1.0] * 5, [2.0] * 5))
    assert prefetch.choose_one_row_prefetch(model) is True
    assert qmatmul().prefetch_rows() == prefetch.ONE_ROW
