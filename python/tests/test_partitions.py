"""Tests of the NumPy API of plsh: the import, the ALiBi slopes, the random partitions
(RandomBinning, head_seed, draw_head_grids, kernel_grids) and mask_error."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

import plsh
from conftest import same_bin


def test_import_plsh_does_not_import_torch():
    code = "import sys, plsh; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ), check=True)
    assert result.stdout.strip() == "False"


def test_alibi_slopes_are_press_et_al_geometric_sequence():
    for heads in (1, 2, 4, 8, 16):
        expected = [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]
        assert plsh.alibi_slopes(heads) == pytest.approx(expected, rel=1e-15)
    # Not a power of two: the 8 slopes of 8 heads, then every other slope of 16 heads.
    assert plsh.alibi_slopes(12) == pytest.approx(
        plsh.alibi_slopes(8) + plsh.alibi_slopes(16)[0::2][:4], rel=1e-15)
    with pytest.raises(ValueError, match="alibi_slopes"):
        plsh.alibi_slopes(0)


def test_random_binning_draws_are_a_pure_function_of_slope_seed_and_index():
    sampler = plsh.RandomBinning(0.125, seed=7)
    assert sampler.slope == 0.125 and sampler.seed == 7
    grids = sampler.draw(6)
    assert grids == [sampler(t) for t in range(6)]
    assert sampler.draw(3, first=2) == grids[2:5]
    assert plsh.RandomBinning(0.125, 7).draw(6) == grids
    assert plsh.RandomBinning(0.125, 8).draw(6) != grids
    assert all(0 <= g.shift < g.pitch for g in grids)
    assert math.isinf(plsh.RandomBinning(0.0)(3).pitch)
    assert repr(plsh.Grid(2.0, 0.5)) == "Grid(pitch=2.0, shift=0.5)"
    with pytest.raises(ValueError, match=r"RandomBinning: slope must be finite and non-negative"):
        plsh.RandomBinning(-1.0)
    with pytest.raises(ValueError, match="count must be non-negative"):
        sampler.draw(-1)


def test_random_binning_co_locates_with_the_alibi_probability():
    slope, draws = 0.25, 4000
    grids = plsh.RandomBinning(slope, seed=3).draw(draws)
    for distance in (1, 4, 8):
        together = np.mean([same_bin(g, np.int64(10), np.int64(10 + distance)) for g in grids])
        expected = math.exp(-slope * distance)
        # Binomial standard deviation, five of them.
        assert abs(together - expected) < 5 * math.sqrt(expected * (1 - expected) / draws)


def test_draw_head_grids_and_head_seed():
    slopes = plsh.alibi_slopes(4)
    grids = plsh.draw_head_grids(slopes, 5, 11)
    for h, slope in enumerate(slopes):
        assert grids[h] == plsh.RandomBinning(slope, plsh.head_seed(11, h)).draw(5)
    assert plsh.head_seed(11, 0) != plsh.head_seed(11, 1)


def test_kernel_grids_follow_the_sampling():
    slopes = [0.5, 0.1, 0.01]
    independent = plsh.draw_head_grids(slopes, 6, 11)
    assert plsh.kernel_grids(slopes, 6, 11, sampling="independent") == independent
    latin = plsh.kernel_grids(slopes, 6, 11, sampling="latin_hypercube")
    assert latin == plsh.kernel_grids(slopes, 6, 11)  # the default, as the kernels'
    assert plsh.PLSH_DEFAULTS["sampling"] == "latin_hypercube"
    assert [len(head) for head in latin] == [6, 6, 6]
    for h in range(len(slopes)):
        assert latin[h] != independent[h]
        assert all(0 <= g.shift < g.pitch for g in latin[h])
        # The uniform of the shift, shift / pitch, takes one value in each stratum [k/6, (k+1)/6).
        assert sorted(math.floor(6 * g.shift / g.pitch) for g in latin[h]) == list(range(6))
    # One draw: its one stratum is [0, 1), and latin_hypercube_grids (plsh/sampler.hpp) makes it
    # the independent draw RandomBinning(slope, seed)(0).
    assert plsh.kernel_grids(slopes, 1, 11, sampling="latin_hypercube") == \
        plsh.draw_head_grids(slopes, 1, 11)


def test_latin_hypercube_draws_co_locate_with_the_alibi_probability():
    # Every draw has the Random Binning law; a Latin hypercube's variance is at most
    # s/(s - 1) times that of s independent draws (Owen 1997), so the binomial bound holds.
    slope, draws = 0.25, 4000
    grids = plsh.kernel_grids([slope], draws, 3, sampling="latin_hypercube")[0]
    for distance in (1, 4, 8):
        together = np.mean([same_bin(g, np.int64(10), np.int64(10 + distance)) for g in grids])
        expected = math.exp(-slope * distance)
        assert abs(together - expected) < 5 * math.sqrt(expected * (1 - expected) / (draws - 1))


def test_mask_error_against_numpy():
    n, slope = 24, 0.2
    grids = plsh.RandomBinning(slope, seed=5).draw(20)
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    mean_mask = np.mean([same_bin(g, i, j) for g in grids], axis=0)
    error = mean_mask - np.exp(-slope * np.abs(i - j))
    result = plsh.mask_error(n, slope, grids)
    assert result.max == pytest.approx(np.abs(error).max(), abs=1e-15)
    assert result.spectral == pytest.approx(np.abs(np.linalg.eigvalsh(error)).max(), rel=1e-12)
    assert "MaskError(spectral=" in repr(result)
    with pytest.raises(ValueError, match=r"^mask_error: n must lie in \[1, kMaxPosition\]"):
        plsh.mask_error(0, slope, grids)
