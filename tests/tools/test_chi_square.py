"""The sampling check itself (tools/benchmark/chi_square.py), against scipy's test on bins built
by hand and against draws of known distributions."""

import numpy as np
import pytest
import scipy.stats
import torch

from specdec.tools.benchmark.chi_square import chi_square_counts, chi_square_p_value


def test_bins_expected_often_enough_are_scipys_test():
    counts = np.array([48, 35, 17])
    probs = np.array([0.5, 0.3, 0.2])
    statistic, p_value = chi_square_counts(counts, probs)
    reference = scipy.stats.chisquare(counts, probs * counts.sum())
    assert statistic == pytest.approx(reference.statistic)
    assert p_value == pytest.approx(reference.pvalue)


def test_rare_bins_are_merged_and_a_small_pool_folds_into_the_smallest_bin():
    probs = np.array([0.6, 0.3, 0.08, 0.01, 0.01])  # of 100 draws: 60, 30, 8, 1, 1 expected
    counts = np.array([55, 33, 9, 2, 1])
    # the pool of the last two (expected 2) is still under 5: it joins the bin expected 8 times
    reference = scipy.stats.chisquare([55, 33, 12], [60, 30, 10])
    assert chi_square_counts(counts, probs) == pytest.approx((reference.statistic, reference.pvalue))


def test_draws_of_the_distribution_pass_and_of_another_fail():
    rng = np.random.default_rng(1234)
    probs = rng.dirichlet(np.ones(30))
    p_values = [chi_square_p_value(rng.choice(30, 20_000, p=probs), probs) for _ in range(20)]
    assert scipy.stats.kstest(p_values, "uniform").pvalue > 1e-3  # p-values of a true null are uniform
    other = np.roll(probs, 1)
    assert chi_square_p_value(rng.choice(30, 20_000, p=other), probs) < 1e-6


def test_tensors_and_unnormalised_probs_are_taken():
    gen = torch.Generator().manual_seed(7)
    weights = torch.rand(12, generator=gen) + 0.1
    samples = torch.multinomial(weights, 5_000, replacement=True, generator=gen)
    assert chi_square_p_value(samples, weights) == pytest.approx(chi_square_p_value(samples.numpy(), weights / 12))


def test_an_outcome_of_probability_zero_is_an_error_not_a_p_value():
    with pytest.raises(ValueError, match="probability 0: \\[2\\]"):
        chi_square_p_value([0, 1, 2, 0], [0.5, 0.5, 0.0])
    with pytest.raises(ValueError, match="beyond the 3 probabilities"):
        chi_square_p_value([0, 5], [0.5, 0.25, 0.25])


def test_one_possible_outcome_cannot_differ():
    assert chi_square_counts([10, 0], [1.0, 0.0]) == (0.0, 1.0)
