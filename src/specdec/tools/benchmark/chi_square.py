"""The sampling check: do draws follow an exact distribution? Pearson's chi-square of the draws'
counts against the probabilities (scipy's test; `pip install "specdec[test]"` brings scipy).

Terms:
  bin       one outcome (a token id); its expected count is its probability times the draws
  merged    the bins expected fewer than 5 times, pooled into one (the test's approximation needs
            about 5 a bin); if the pool is itself expected fewer than 5 times, it joins the
            smallest other bin
  impossible  an outcome of probability 0 that was drawn: the draws do not follow probs, whatever
            the statistic says (raised, not tested)
"""

from __future__ import annotations

import numpy as np
import torch

MIN_EXPECTED = 5  # a bin expected fewer times than this is merged


def chi_square_counts(counts, probs, what: str = "samples") -> tuple[float, float]:
    """(statistic, p-value) of counts (per outcome) against probs (numpy arrays or tensors, the
    same length; probs need not sum to 1). Raises ValueError on an impossible outcome."""
    from scipy.stats import chisquare

    probs = _float64(probs)
    probs = probs / probs.sum()
    counts = _float64(counts)
    if counts.shape != probs.shape:
        raise ValueError(f"{what}: {counts.shape[0]} counts for {probs.shape[0]} probabilities")
    impossible = np.flatnonzero((counts > 0) & (probs == 0))
    if len(impossible):
        raise ValueError(f"{what}: sampled outcomes of probability 0: {impossible[:10].tolist()}")
    expected = probs * counts.sum()
    big = expected >= MIN_EXPECTED
    observed_bins, expected_bins = list(counts[big]), list(expected[big])
    if (~big & (probs > 0)).any():
        observed_bins.append(counts[~big].sum())
        expected_bins.append(expected[~big].sum())
        if expected_bins[-1] < MIN_EXPECTED and len(expected_bins) > 1:  # still too small: fold it in
            smallest = int(np.argmin(expected_bins[:-1]))
            observed_bins[smallest] += observed_bins.pop()
            expected_bins[smallest] += expected_bins.pop()
    if len(expected_bins) < 2:  # one bin: nothing can differ
        return 0.0, 1.0
    result = chisquare(observed_bins, expected_bins)
    return float(result.statistic), float(result.pvalue)


def chi_square_p_value(samples, probs, what: str = "samples") -> float:
    """The p-value of integer samples (outcome ids) against probs (chi_square_counts)."""
    probs = _float64(probs)
    counts = np.bincount(np.asarray(samples).reshape(-1), minlength=len(probs))
    if len(counts) > len(probs):
        raise ValueError(f"{what}: sampled outcome {len(counts) - 1}, beyond the {len(probs)} probabilities")
    return chi_square_counts(counts, probs, what)[1]


def _float64(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().double().cpu().numpy()
    return np.asarray(values, dtype=np.float64).reshape(-1)
