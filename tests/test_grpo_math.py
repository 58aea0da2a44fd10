"""Advantages and dynamic-sampling selection against hand-computed values."""

import numpy as np
import pytest

from dataplane_rl.algorithms.grpo import advantages, group_std, informative_groups


def test_group_mean_baseline_normalised():
    # group 0: rewards 1, 0 -> mean 0.5, std 0.5 -> A = +-0.5 / (0.5 + 1e-6) ~ +-1
    # group 1: rewards 2, 2, 2 -> all equal -> A = 0 (std 0, 0 / 1e-6 = 0)
    r = np.array([1.0, 0.0, 2.0, 2.0, 2.0])
    g = np.array([0, 0, 1, 1, 1])
    a = advantages(r, g)
    np.testing.assert_allclose(a, [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0, 0, 0], rtol=1e-6)


def test_unnormalised_and_leave_one_out():
    # group: 3, 1, 2. mean 2 -> R - b = 1, -1, 0
    # leave-one-out: b = mean of others = (1+2)/2, (3+2)/2, (3+1)/2 = 1.5, 2.5, 2 -> 1.5, -1.5, 0
    r = np.array([3.0, 1.0, 2.0])
    g = np.array([7, 7, 7])
    np.testing.assert_allclose(advantages(r, g, normalize=False), [1, -1, 0])
    np.testing.assert_allclose(advantages(r, g, normalize=False, leave_one_out=True), [1.5, -1.5, 0])
    # normalised leave-one-out divides by the std of the FULL group: sqrt(2/3)
    np.testing.assert_allclose(advantages(r, g, leave_one_out=True),
                               np.array([1.5, -1.5, 0]) / (np.sqrt(2 / 3) + 1e-6), rtol=1e-6)


def test_groups_need_not_be_contiguous():
    r = np.array([1.0, 5.0, 0.0, 5.0])
    g = np.array([0, 1, 0, 1])
    np.testing.assert_allclose(advantages(r, g, normalize=False), [0.5, 0, -0.5, 0])
    np.testing.assert_allclose(group_std(r, g), [0.5, 0, 0.5, 0])


def test_informative_groups_use_full_group_spread():
    r = np.array([1.0, 1.0, 0.0, 1.0, 0.3, 0.3])
    g = np.array([4, 4, 2, 2, 9, 9])
    assert informative_groups(r, g).tolist() == [2]


def test_leave_one_out_needs_two():
    with pytest.raises(ValueError):
        advantages(np.array([1.0]), np.array([0]), leave_one_out=True)
