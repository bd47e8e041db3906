"""Tests of the NumPy API of plsh: every function against dense references and the C++ kernels,
batches, strided arrays, out=, KvCache, error paths, and the GIL."""

import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import plsh
from conftest import (UNIT_ROUNDOFF, alibi_log_factor, fixed_log_factor, from_bfloat16_bits,
                      random_inputs, reference_attention, same_bin, to_bfloat16_bits)

FORWARD_TOLERANCE = {np.float64: 1e-12, np.float32: 3e-5}


def call_forward(name, q, k, v, **kwargs):
    """The forward `name` with its required extra argument."""
    if name == "fixed_block_attention":
        return plsh.fixed_block_attention(q, k, v, 8, **kwargs)
    return getattr(plsh, name)(q, k, v, **kwargs)


FORWARDS = ["exact_alibi_attention", "windowed_alibi_attention", "plsh_attention",
            "fixed_block_attention"]


# ---------------------------------------------------------------------------------------------
# Import, slopes, sampler, metrics
# ---------------------------------------------------------------------------------------------

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
    assert plsh.kernel_grids(slopes, 6, 11) == independent
    assert plsh.kernel_grids(slopes, 6, 11, sampling="independent") == independent
    latin = plsh.kernel_grids(slopes, 6, 11, sampling="latin_hypercube")
    assert latin == plsh.kernel_grids(slopes, 6, 11, sampling="latin_hypercube")
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


# ---------------------------------------------------------------------------------------------
# Forward kernels against dense references
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("positions", [(0, 0), (30, 5), (3, 20)])
def test_forward_kernels_against_dense_references(dtype, causal, positions):
    query_position, key_position = positions
    q, k, v = random_inputs((2, 37, 4, 8), kv_heads=2, value_dim=5, n_k=45, seed=2, dtype=dtype)
    slopes = [0.5, 0.25, 0.1, 0.0]
    options = dict(causal=causal, query_position=query_position, key_position=key_position)
    tolerance = FORWARD_TOLERANCE[dtype]
    cases = {
        "exact": (plsh.exact_alibi_attention(q, k, v, slopes, **options), alibi_log_factor(slopes)),
        "fused": (plsh.plsh_attention(q, k, v, slopes, samples=6, seed=4, **options),
                  alibi_log_factor(slopes, 6, 4)),
        "passes": (plsh.plsh_attention(q, k, v, slopes, samples=6, seed=4, kernel="passes",
                                       **options), alibi_log_factor(slopes, 6, 4)),
        "fused latin": (plsh.plsh_attention(q, k, v, slopes, samples=6, seed=4,
                                            sampling="latin_hypercube", **options),
                        alibi_log_factor(slopes, 6, 4, "latin_hypercube")),
        "passes latin": (plsh.plsh_attention(q, k, v, slopes, samples=6, seed=4,
                                             sampling="latin_hypercube", kernel="passes",
                                             **options),
                         alibi_log_factor(slopes, 6, 4, "latin_hypercube")),
        "fixed": (plsh.fixed_block_attention(q, k, v, 8, **options), fixed_log_factor(8)),
    }
    for name, (result, log_factor) in cases.items():
        assert result.dtype == dtype and result.shape == (2, 37, 4, 5), name
        expected = reference_attention(q, k, v, log_factor, **options)
        np.testing.assert_allclose(result, expected, rtol=0, atol=tolerance, err_msg=name)


def test_scale_and_default_slopes(inputs):
    q, k, v = inputs
    result = plsh.exact_alibi_attention(q, k, v, scale=0.3)
    expected = reference_attention(q, k, v, alibi_log_factor(plsh.alibi_slopes(4)), scale=0.3)
    np.testing.assert_allclose(result, expected, rtol=0, atol=1e-12)


def test_windowed_kernel(inputs):
    q, k, v = inputs
    exact = plsh.exact_alibi_attention(q, k, v)
    # tolerance 0 keeps every key: the exact kernel's arithmetic, bit for bit.
    np.testing.assert_array_equal(plsh.windowed_alibi_attention(q, k, v, tolerance=0.0), exact)
    np.testing.assert_allclose(plsh.windowed_alibi_attention(q, k, v), exact, rtol=0, atol=1e-5)


def test_plsh_is_unbiased_for_alibi_in_the_mean_mask():
    # Many draws: the estimator approaches exact ALiBi (error ~ 1/sqrt(samples)).
    q, k, v = random_inputs((64, 2, 8), kv_heads=2, value_dim=4, seed=6, query_amplitude=0.5)
    exact = plsh.exact_alibi_attention(q, k, v, [0.2, 0.05])
    few = plsh.plsh_attention(q, k, v, [0.2, 0.05], samples=4, seed=1)
    many = plsh.plsh_attention(q, k, v, [0.2, 0.05], samples=400, seed=1)
    assert np.abs(many - exact).max() < 0.5 * np.abs(few - exact).max()


def test_latin_hypercube_attention_differs_from_independent_except_with_one_draw(inputs):
    q, k, v = inputs
    latin = plsh.plsh_attention(q, k, v, samples=6, seed=2, sampling="latin_hypercube")
    assert not np.array_equal(latin, plsh.plsh_attention(q, k, v, samples=6, seed=2))
    # samples = 1: the same grids (test_kernel_grids_follow_the_sampling), the same output.
    np.testing.assert_array_equal(
        plsh.plsh_attention(q, k, v, samples=1, seed=2, sampling="latin_hypercube"),
        plsh.plsh_attention(q, k, v, samples=1, seed=2))


def test_fused_and_passes_agree_to_rounding(inputs):
    q, k, v = (x.astype(np.float32) for x in inputs)
    fused = plsh.plsh_attention(q, k, v, samples=8, seed=2)
    passes = plsh.plsh_attention(q, k, v, samples=8, seed=2, kernel="passes")
    np.testing.assert_allclose(fused, passes, rtol=0, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------

def reference_backward(q, k, v, dout, log_factor, causal=True, scale=0.0, query_position=0,
                       key_position=0):
    """Dense float64 gradients (dq, dk, dv) of reference_attention, rank 3."""
    n_q, heads, dim = q.shape
    n_k, kv_heads, _ = v.shape
    group = heads // kv_heads
    scale = scale if scale != 0 else 1.0 / math.sqrt(dim)
    i = query_position + np.arange(n_q)[:, None]
    j = key_position + np.arange(n_k)[None, :]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for h in range(heads):
        g = h // group
        logits = scale * q[:, h] @ k[:, g].T + log_factor(h, i, j)
        if causal:
            logits = np.where(j > i, -np.inf, logits)
        top = logits.max(axis=1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0)
        weights = np.exp(logits - top)
        sums = weights.sum(axis=1, keepdims=True)
        p = weights / np.where(sums > 0, sums, 1)
        out = p @ v[:, g]
        dp = dout[:, h] @ v[:, g].T
        ds = p * (dp - (dout[:, h] * out).sum(axis=1, keepdims=True))
        dq[:, h] = scale * ds @ k[:, g]
        dk[:, g] += scale * ds.T @ q[:, h]
        dv[:, g] += p.T @ dout[:, h]
    return dq, dk, dv


@pytest.mark.parametrize("method", ["exact", "plsh", "plsh latin"])
def test_backward_kernels_against_dense_reference(method):
    q, k, v = random_inputs((33, 4, 6), kv_heads=2, value_dim=5, n_k=40, seed=8)
    dout = np.random.default_rng(9).standard_normal((33, 4, 5))
    options = dict(causal=True, query_position=12, key_position=3, scale=0.4)
    slopes = [0.3, 0.1, 0.05, 0.0]
    if method == "exact":
        out = plsh.exact_alibi_attention(q, k, v, slopes, **options)
        grads = plsh.exact_alibi_attention_backward(q, k, v, out, dout, slopes, **options)
        log_factor = alibi_log_factor(slopes)
    else:
        sampling = "latin_hypercube" if method == "plsh latin" else "independent"
        out = plsh.plsh_attention(q, k, v, slopes, samples=5, seed=3, sampling=sampling,
                                  **options)
        grads = plsh.plsh_attention_backward(q, k, v, out, dout, slopes, samples=5, seed=3,
                                             sampling=sampling, **options)
        log_factor = alibi_log_factor(slopes, 5, 3, sampling)
    expected = reference_backward(q, k, v, dout, log_factor, **options)
    for name, result, reference in zip(("dq", "dk", "dv"), grads, expected):
        assert result.shape == reference.shape
        np.testing.assert_allclose(result, reference, rtol=0, atol=1e-11, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Batches, strides, out=
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORWARDS)
def test_batched_forward_equals_per_item_calls(name, inputs):
    q, k, v = (x.astype(np.float32) for x in inputs)
    batched = call_forward(name, q, k, v, query_position=4)
    for b in range(q.shape[0]):
        np.testing.assert_array_equal(batched[b], call_forward(name, q[b], k[b], v[b],
                                                               query_position=4))


@pytest.mark.parametrize("method", ["exact", "plsh"])
def test_batched_backward_equals_per_item_calls(method, inputs):
    q, k, v = inputs
    backward = (plsh.exact_alibi_attention_backward if method == "exact"
                else plsh.plsh_attention_backward)
    out = plsh.exact_alibi_attention(q, k, v)
    dout = np.random.default_rng(3).standard_normal(out.shape)
    batched = backward(q, k, v, out, dout)
    for b in range(q.shape[0]):
        single = backward(q[b], k[b], v[b], out[b], dout[b])
        for result, expected in zip(batched, single):
            np.testing.assert_array_equal(result[b], expected)


def strided_copies(x):
    """Views of x's values with other layouts: head-major, sliced with gaps, reversed tokens (a
    negative stride: copied), a non-contiguous last axis (copied)."""
    head_major = np.ascontiguousarray(np.swapaxes(x, -2, -3)).swapaxes(-2, -3)
    padded = np.zeros(x.shape[:-1] + (2 * x.shape[-1] + 1,), x.dtype)[..., 1:1 + x.shape[-1]]
    padded[...] = x
    gaps = np.zeros((2 * x.shape[0],) + x.shape[1:], x.dtype)[::2]
    gaps[...] = x
    reversed_tokens = np.ascontiguousarray(x[..., ::-1, :, :])[..., ::-1, :, :]
    spread_last = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)[..., ::2]
    spread_last[...] = x
    return {"head-major": head_major, "padded": padded, "batch gaps": gaps,
            "negative stride": reversed_tokens, "strided last axis": spread_last}


@pytest.mark.parametrize("name", FORWARDS)
def test_strided_inputs_give_the_same_bits(name, inputs):
    q, k, v = (x.astype(np.float32) for x in inputs)
    expected = call_forward(name, q, k, v)
    for layout, q_view in strided_copies(q).items():
        assert np.array_equal(q_view, q)
        k_view = strided_copies(k)[layout]
        v_view = strided_copies(v)[layout]
        np.testing.assert_array_equal(call_forward(name, q_view, k_view, v_view), expected,
                                      err_msg=layout)


def test_strided_backward_inputs_and_outputs(inputs):
    q, k, v = inputs
    out = plsh.plsh_attention(q, k, v, seed=5)
    dout = np.random.default_rng(4).standard_normal(out.shape)
    expected = plsh.plsh_attention_backward(q, k, v, out, dout, seed=5)
    views = [strided_copies(x)["head-major"] for x in (q, k, v, out, dout)]
    dq, dk, dv = (strided_copies(np.zeros_like(x))["padded"] for x in (q, k, v))
    result = plsh.plsh_attention_backward(*views, seed=5, dq=dq, dk=dk, dv=dv)
    assert result[0] is dq and result[1] is dk and result[2] is dv
    for r, e in zip(result, expected):
        np.testing.assert_array_equal(r, e)


def test_out_argument_writes_in_place_through_strides(inputs):
    q, k, v = inputs
    expected = plsh.exact_alibi_attention(q, k, v)
    storage = np.full((2, 4, 40, 6), -7.0)
    out = storage.transpose(0, 2, 1, 3)  # [2, 40, 4, 6] head-major
    assert plsh.exact_alibi_attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, expected)
    single = np.empty((40, 4, 6))
    assert plsh.exact_alibi_attention(q[0], k[0], v[0], out=single) is single
    np.testing.assert_array_equal(single, expected[0])


def test_zero_copy_of_usable_layouts(inputs):
    # An input read in place: the kernel sees a change made after the view was taken.
    q, k, v = inputs
    storage = np.ascontiguousarray(np.swapaxes(q, 1, 2))
    q_view = storage.swapaxes(1, 2)
    first = plsh.exact_alibi_attention(q_view, k, v)
    storage *= 0.5
    np.testing.assert_array_equal(plsh.exact_alibi_attention(q_view, k, v),
                                  plsh.exact_alibi_attention(q * 0.5, k, v))
    assert not np.array_equal(first, plsh.exact_alibi_attention(q_view, k, v))


def test_zero_tokens_and_heads_one():
    q, k, v = random_inputs((0, 2, 4), kv_heads=1, value_dim=3)
    assert plsh.plsh_attention(q, k, v).shape == (0, 2, 3)
    q, k, v = random_inputs((1, 1, 1), kv_heads=1, value_dim=1)
    np.testing.assert_allclose(plsh.exact_alibi_attention(q, k, v), v)


BACKWARDS = {"exact": (plsh.exact_alibi_attention_backward, ()),
             "plsh": (plsh.plsh_attention_backward, ()),
             "fixed": (plsh.fixed_block_attention_backward, (8,))}


@pytest.mark.parametrize("name", FORWARDS)
def test_batches_of_zero_token_elements_give_empty_outputs(name):
    q, k, v = (np.zeros((2, 0, 4, 8), np.float32),) * 3
    assert call_forward(name, q, k, v).shape == (2, 0, 4, 8)
    assert call_forward(name, q, k, v, out=np.empty((2, 0, 4, 8), np.float32)).shape == (2, 0, 4, 8)


@pytest.mark.parametrize("method", BACKWARDS)
def test_backward_of_zero_token_batches_gives_empty_gradients(method):
    function, extra = BACKWARDS[method]
    q, k, v, out, dout = (np.zeros((2, 0, 4, 8), np.float32),) * 5
    gradients = function(q, k, v, out, dout, *extra)
    assert [g.shape for g in gradients] == [(2, 0, 4, 8)] * 3


def empty_batch_cases():
    """(description, call, message) for calls on a batch of 0 elements that break a rule."""
    q, k, v = random_inputs((0, 5, 4, 8), kv_heads=2, value_dim=6, dtype=np.float32)
    odd_q = np.zeros((0, 5, 3, 8), np.float32)
    narrow_k = np.zeros((0, 5, 2, 7), np.float32)
    out = np.zeros((0, 5, 4, 6), np.float32)
    nan = float("nan")
    return [
        ("heads", lambda: plsh.exact_alibi_attention(odd_q, k, v), "multiple of k.heads"),
        ("dims", lambda: plsh.exact_alibi_attention(q, narrow_k, v), "k.dim must equal q.dim"),
        ("slopes", lambda: plsh.windowed_alibi_attention(q, k, v, [0.5, nan, 0.1, 0.2]),
         r"slopes\[1\] must be finite"),
        ("samples", lambda: plsh.plsh_attention(q, k, v, samples=0), "options.samples"),
        ("scale", lambda: plsh.fixed_block_attention(q, k, v, 4, scale=nan),
         "options.scale must be finite"),
        ("position", lambda: plsh.plsh_attention(q, k, v, query_position=-100),
         "options.query_position"),
        ("backward position", lambda: plsh.exact_alibi_attention_backward(
            q, k, v, out, out, query_position=-100), "options.query_position"),
        ("out aliasing q", lambda: plsh.exact_alibi_attention(q, k, k, out=q), "out overlaps q"),
    ]


@pytest.mark.parametrize("case", range(len(empty_batch_cases())))
def test_an_empty_batch_is_checked_like_a_batch_of_one(case):
    description, call, message = empty_batch_cases()[case]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("argument, value", [
    ("seed", -1), ("seed", 2 ** 64), ("samples", 2 ** 64), ("query_position", 2 ** 63),
    ("key_position", -2 ** 63 - 1)])
def test_integers_out_of_range_name_the_argument_and_the_range(argument, value, inputs):
    q, k, v = inputs
    with pytest.raises(ValueError, match=rf"^{argument} must be an integer in \[-?\d+, \d+\] "
                                         rf"\(got {value}\)$"):
        plsh.plsh_attention(q, k, v, **{argument: value})
    with pytest.raises(ValueError, match=rf"^{argument} must be an integer in"):
        plsh.plsh_attention_backward(q, k, v, q, q, **{argument: value})


def test_integer_arguments_of_every_function_are_range_checked(inputs):
    q, k, v = inputs
    with pytest.raises(ValueError, match="^block_size must be an integer in"):
        plsh.fixed_block_attention(q, k, v, 2 ** 64)
    with pytest.raises(ValueError, match="^block_size must be an integer in"):
        plsh.fixed_block_attention_backward(q, k, v, q, q, 2 ** 64)
    with pytest.raises(ValueError, match="^seed must be an integer in"):
        plsh.KvCache(4, 2, 8, 8, seed=-1)
    with pytest.raises(ValueError, match="^heads must be an integer in"):
        plsh.KvCache(2 ** 63, 2, 8, 8)
    with pytest.raises(ValueError, match="^seed must be an integer in"):
        plsh.RandomBinning(0.5, seed=-1)
    with pytest.raises(ValueError, match="^index must be an integer in"):
        plsh.RandomBinning(0.5)(-1)
    with pytest.raises(ValueError, match="^samples must be an integer in"):
        plsh.kernel_grids([0.5], 2 ** 64)
    with pytest.raises(TypeError, match="^seed must be an integer \\(got float\\)$"):
        plsh.plsh_attention(q, k, v, seed=1.7)
    # NumPy integers are integers; the largest seed is accepted.
    assert np.array_equal(plsh.plsh_attention(q, k, v, seed=np.uint64(2 ** 64 - 1)),
                          plsh.plsh_attention(q, k, v, seed=2 ** 64 - 1))


def test_non_native_byte_order_is_named(inputs):
    q, k, v = inputs
    swapped = q.astype(q.dtype.newbyteorder(">" if np.little_endian else "<"))
    with pytest.raises(TypeError, match="byte order"):
        plsh.exact_alibi_attention(swapped, k, v)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_dtype_errors_name_the_argument(inputs):
    q, k, v = inputs
    with pytest.raises(TypeError, match=r"^q must be a numpy.ndarray \(got list\)"):
        plsh.exact_alibi_attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match=r"^q has dtype int64; plsh takes float32, float64, "
                                        r"float16, or bfloat16 as uint16"):
        plsh.plsh_attention(q.astype(np.int64), k, v)
    with pytest.raises(TypeError, match=r"^q has dtype uint16; .*pass bfloat16=True"):
        plsh.exact_alibi_attention(q.astype(np.uint16), k, v)
    with pytest.raises(TypeError, match=r"^q has dtype float32; with bfloat16=True the arrays "
                                        r"hold bfloat16 bit patterns as uint16"):
        plsh.exact_alibi_attention(q.astype(np.float32), k, v, bfloat16=True)
    with pytest.raises(TypeError, match=r"^k has dtype float64 but q has float16"):
        plsh.exact_alibi_attention(q.astype(np.float16), k, v)
    with pytest.raises(TypeError, match=r"^v has dtype float16 but q has bfloat16"):
        plsh.exact_alibi_attention(q.astype(np.uint16), k.astype(np.uint16), v.astype(np.float16),
                                   bfloat16=True)
    with pytest.raises(TypeError, match=r"^out must have dtype float16 like q \(got float32\)"):
        plsh.exact_alibi_attention(q.astype(np.float16), k.astype(np.float16),
                                   v.astype(np.float16), out=np.empty((2, 40, 4, 6), np.float32))
    with pytest.raises(TypeError, match=r"^k has dtype float32 but q has float64"):
        plsh.exact_alibi_attention(q, k.astype(np.float32), v)
    with pytest.raises(TypeError, match=r"^v has dtype float32 but q has float64"):
        plsh.windowed_alibi_attention(q, k, v.astype(np.float32))
    with pytest.raises(TypeError, match=r"^dout has dtype float32 but q has float64"):
        plsh.exact_alibi_attention_backward(q, k, v, q[..., :6], q[..., :6].astype(np.float32))
    with pytest.raises(TypeError, match=r"^out must have dtype float64 like q \(got float32\)"):
        plsh.exact_alibi_attention(q, k, v, out=np.empty((2, 40, 4, 6), np.float32))
    with pytest.raises(TypeError, match=r"^dk must have dtype float64"):
        plsh.exact_alibi_attention_backward(q, k, v, q[..., :6], q[..., :6],
                                            dk=np.empty(k.shape, np.float32))
    # Byte-swapped float64 is not the native dtype.
    with pytest.raises(TypeError, match=r"^q has dtype >f8"):
        plsh.exact_alibi_attention(q.astype(">f8"), k, v)


def test_rank_and_shape_errors_name_the_argument(inputs):
    q, k, v = inputs
    with pytest.raises(ValueError, match=r"^q must have 3 dimensions .* \(got 2\)"):
        plsh.exact_alibi_attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"^k must have 4 dimensions like q \(got 3\)"):
        plsh.exact_alibi_attention(q, k[0], v)
    with pytest.raises(ValueError, match=r"^v.shape\[0\] \(batch, 1\) must equal q.shape\[0\] \(2\)"):
        plsh.exact_alibi_attention(q, k, v[:1])
    with pytest.raises(ValueError, match=r"^exact_alibi_attention: k.dim must equal q.dim$"):
        plsh.exact_alibi_attention(q, k[..., :5], v)
    with pytest.raises(ValueError, match=r"q.heads must be a multiple of k.heads"):
        plsh.plsh_attention(q[..., :3, :], k, v)
    with pytest.raises(ValueError, match=r"^v.tokens must equal k.tokens|v.tokens must equal"):
        plsh.fixed_block_attention(q, k, v[:, :5], 4)
    with pytest.raises(ValueError, match=r"^out must have shape \(2, 40, 4, 6\) \(got \(2, 40, 4, 5\)\)"):
        plsh.exact_alibi_attention(q, k, v, out=np.empty((2, 40, 4, 5)))
    with pytest.raises(ValueError, match=r"dout.dim must equal out.dim"):
        plsh.exact_alibi_attention_backward(q, k, v, q[..., :6], q[..., :5])
    with pytest.raises(ValueError, match=r"^dq must have shape"):
        plsh.plsh_attention_backward(q, k, v, q[..., :6], q[..., :6], dq=np.empty(k.shape))


def test_out_errors(inputs):
    q, k, v = inputs
    read_only = np.empty((2, 40, 4, 6))
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match=r"^out is read-only"):
        plsh.exact_alibi_attention(q, k, v, out=read_only)
    reversed_out = np.empty((2, 40, 4, 6))[:, ::-1]
    with pytest.raises(ValueError, match=r"^out must have strides that are positive multiples"):
        plsh.exact_alibi_attention(q, k, v, out=reversed_out)
    spread = np.empty((2, 40, 4, 12))[..., ::2]
    with pytest.raises(ValueError, match=r"^out must have strides"):
        plsh.exact_alibi_attention(q, k, v, out=spread)
    with pytest.raises(TypeError, match=r"^out must be a numpy.ndarray"):
        plsh.exact_alibi_attention(q, k, v, out=[0.0])
    # out on the memory of an input.
    values = v.copy()
    with pytest.raises(ValueError, match=r"^exact_alibi_attention: out overlaps v"):
        plsh.exact_alibi_attention(q[:, :, :2], k, values, out=values)
    # out overlapping itself (a broadcast view has stride 0).
    broadcast = np.broadcast_to(np.empty((1, 40, 4, 6)), (2, 40, 4, 6))
    with pytest.raises(ValueError, match=r"out"):
        plsh.exact_alibi_attention(q, k, v, out=broadcast)
    grads = [np.empty(x.shape) for x in (q, k)]
    with pytest.raises(ValueError, match=r"dv overlaps dk"):
        plsh.exact_alibi_attention_backward(q, k, k[..., :6].copy(), q[..., :6], q[..., :6],
                                            dq=grads[0], dk=grads[1], dv=grads[1][..., :6])


def test_option_errors_are_value_errors_with_the_cpp_message(inputs):
    q, k, v = inputs
    with pytest.raises(ValueError, match=r"^exact_alibi_attention: slopes.size\(\) \(3\) must "
                                         r"equal q.heads \(4\)$"):
        plsh.exact_alibi_attention(q, k, v, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"slopes\[1\] must be finite and non-negative"):
        plsh.plsh_attention(q, k, v, [0.1, -0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match=r"^plsh_attention: options.samples must lie in \[1, kMaxSamples = 65536\] \(got 0\)"):
        plsh.plsh_attention(q, k, v, samples=0)
    with pytest.raises(ValueError, match=r'^kernel must be "fused" or "passes" \(got "dense"\)'):
        plsh.plsh_attention(q, k, v, kernel="dense")
    sampling_error = r'^sampling must be "independent" or "latin_hypercube" \(got "%s"\)$'
    with pytest.raises(ValueError, match=sampling_error % "stratified"):
        plsh.plsh_attention(q, k, v, sampling="stratified")
    with pytest.raises(ValueError, match=sampling_error % "Latin_Hypercube"):
        plsh.plsh_attention_backward(q, k, v, q[..., :6], q[..., :6], sampling="Latin_Hypercube")
    with pytest.raises(ValueError, match=sampling_error % ""):
        plsh.kernel_grids([0.1], 4, 0, sampling="")
    with pytest.raises(ValueError, match=r"^kernel_grids: options.samples must lie in \[1, "):
        plsh.kernel_grids([0.1], 0, 0, sampling="latin_hypercube")
    with pytest.raises(ValueError, match=r"^kernel_grids: slopes\[0\] must be finite"):
        plsh.kernel_grids([-0.1], 4, 0)
    with pytest.raises(ValueError, match=r"options.query_position \+ q.tokens must lie in \[0, kMaxPosition = 2\^53\]"):
        plsh.exact_alibi_attention(q, k, v, query_position=-1)
    with pytest.raises(ValueError, match=r"options.key_position \+ k.tokens must lie in \[0, kMaxPosition = 2\^53\]"):
        plsh.plsh_attention_backward(q, k, v, q[..., :6], q[..., :6], key_position=-1)
    with pytest.raises(ValueError, match=r"options.scale must be finite"):
        plsh.exact_alibi_attention(q, k, v, scale=math.inf)
    with pytest.raises(ValueError, match=r"^fixed_block_attention: block_size must be at least 1"):
        plsh.fixed_block_attention(q, k, v, 0)
    with pytest.raises(ValueError, match=r"tolerance must lie in \[0, 1\]"):
        plsh.windowed_alibi_attention(q, k, v, tolerance=2.0)


# ---------------------------------------------------------------------------------------------
# KvCache
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("sampling", ["independent", "latin_hypercube"])
def test_kv_cache_decode_equals_the_full_forward(dtype, chunk, sampling):
    n, heads, kv_heads, dim, value_dim = 60, 4, 2, 8, 5
    q, k, v = random_inputs((n, heads, dim), kv_heads=kv_heads, value_dim=value_dim, seed=12,
                            dtype=dtype)
    slopes = [0.3, 0.2, 0.1, 0.05]
    full = plsh.plsh_attention(q, k, v, slopes, samples=8, seed=6, sampling=sampling,
                               key_position=0)
    cache = plsh.KvCache(heads, kv_heads, dim, value_dim, slopes, samples=8, seed=6,
                         sampling=sampling, dtype=dtype)
    assert cache.dtype == np.dtype(dtype)
    outputs = []
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        cache.append(k[start:stop], v[start:stop])
        assert cache.position == stop
        assert cache.oldest_position == cache.position - cache.resident
        outputs.append(cache.attend(q[start:stop]))
    if sampling == "independent":
        assert cache.resident < n  # keys no query can reach were forgotten
    else:
        # Here one Latin hypercube block of the slope-0.05 head holds positions 0 to n - 1: the
        # query at n - 1 reaches every key, none can be forgotten.
        grids = plsh.kernel_grids(slopes, 8, 6, sampling=sampling)[3]
        assert any(same_bin(g, np.int64(0), np.int64(n - 1)) for g in grids)
        assert cache.resident == n
    tolerance = 1e-12 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(np.concatenate(outputs), full, rtol=0, atol=tolerance)


def test_kv_cache_out_and_errors():
    cache = plsh.KvCache(2, 1, 4, 3)
    assert cache.dtype == np.float32 and cache.position == 0
    k = np.ones((3, 1, 4), np.float32)
    v = np.ones((3, 1, 3), np.float32)
    cache.append(k, v)
    out = np.empty((2, 2, 3), np.float32)
    assert cache.attend(np.ones((2, 2, 4), np.float32), out=out) is out
    np.testing.assert_allclose(out, 1.0)
    with pytest.raises(TypeError, match=r"^k must have the cache's dtype float32 \(got float64\)"):
        cache.append(k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(TypeError, match=r"^v has dtype float64 but k has float32"):
        cache.append(k, v.astype(np.float64))
    with pytest.raises(ValueError, match=r"^KvCache takes arrays of 3 dimensions"):
        cache.append(k[None], v[None])
    with pytest.raises(ValueError, match=r"^KvCache::append: "):
        cache.append(np.ones((3, 1, 5), np.float32), v)
    with pytest.raises(ValueError, match=r"q.tokens \(4\) must not exceed the tokens of the last "
                                         r"append \(3\)"):
        cache.attend(np.ones((4, 2, 4), np.float32))
    with pytest.raises(ValueError, match=r"^out must have shape \(2, 2, 3\)"):
        cache.attend(np.ones((2, 2, 4), np.float32), out=np.empty((2, 2, 4), np.float32))
    with pytest.raises(ValueError, match=r"^KvCache: heads must be a multiple of kv_heads"):
        plsh.KvCache(3, 2, 4, 4)
    with pytest.raises(ValueError, match=r"^KvCache: slopes.size\(\) \(1\) must equal"):
        plsh.KvCache(2, 1, 4, 4, [0.1])
    with pytest.raises(TypeError, match=r'^dtype must be float32, float64, float16 or "bfloat16" '
                                        r'\(got int32\)'):
        plsh.KvCache(2, 1, 4, 4, dtype=np.int32)
    with pytest.raises(ValueError, match=r"kernel must be"):
        plsh.KvCache(2, 1, 4, 4, kernel="dense")
    with pytest.raises(ValueError, match=r'^sampling must be "independent" or "latin_hypercube" '
                                         r'\(got "lhs"\)$'):
        plsh.KvCache(2, 1, 4, 4, sampling="lhs")


KV_DTYPES = [np.float32, np.float64, np.float16, "bfloat16"]


def kv_arrays(n, heads, kv_heads, dim, value_dim, dtype, seed):
    """q, k, v of n tokens in the arrays a KvCache of `dtype` takes (bfloat16: uint16 bits)."""
    q, k, v = random_inputs((n, heads, dim), kv_heads=kv_heads, value_dim=value_dim, seed=seed,
                            dtype=np.float32)
    if dtype == "bfloat16":
        return [to_bfloat16_bits(x) for x in (q, k, v)]
    return [x.astype(dtype) for x in (q, k, v)]


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_kv_cache_decode_equals_append_then_attend(dtype):
    heads, kv_heads, dim, value_dim = 4, 2, 8, 5
    q, k, v = kv_arrays(50, heads, kv_heads, dim, value_dim, dtype, seed=21)
    caches = [plsh.KvCache(heads, kv_heads, dim, value_dim, samples=6, seed=3, dtype=dtype)
              for _ in range(2)]
    assert caches[0].dtype == (np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype))
    # Steps of 1 token (the single-query path) and of 20 (the fused kernel).
    for start, stop in [(0, 1), (1, 2), (2, 22), (22, 23), (23, 50)]:
        caches[0].append(k[start:stop], v[start:stop])
        expected = caches[0].attend(q[start:stop])
        out = np.empty_like(expected)
        assert caches[1].decode(q[start:stop], k[start:stop], v[start:stop], out=out) is out
        np.testing.assert_array_equal(out, expected)
        assert caches[1].position == caches[0].position == stop
        assert caches[1].resident == caches[0].resident
    assert caches[1].bytes == caches[0].bytes > 0


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_half_kv_cache_is_the_float32_cache_on_rounded_inputs(storage):
    heads, kv_heads, dim, value_dim = 4, 2, 8, 6
    dtype = np.float16 if storage == "float16" else "bfloat16"
    stored = kv_arrays(40, heads, kv_heads, dim, value_dim, dtype, seed=22)
    rounded = [from_storage(x, storage) for x in stored]
    half = plsh.KvCache(heads, kv_heads, dim, value_dim, samples=6, seed=4, dtype=dtype)
    single = plsh.KvCache(heads, kv_heads, dim, value_dim, samples=6, seed=4)
    for start, stop in [(0, 1), (1, 17), (17, 18), (18, 40)]:
        result = half.decode(*(x[start:stop] for x in stored))
        assert result.dtype == stored[0].dtype and result.shape == (stop - start, heads, value_dim)
        assert_rounded(result, single.decode(*(x[start:stop] for x in rounded)), storage,
                       f"tokens {start} to {stop}")
    # The 16-bit cache keeps the same rows in half the bytes.
    assert half.resident == single.resident and 2 * half.bytes == single.bytes


def test_kv_cache_decode_errors_leave_the_cache_as_it_was():
    cache = plsh.KvCache(2, 1, 4, 3, dtype="bfloat16")
    q, k, v = kv_arrays(2, 2, 1, 4, 3, "bfloat16", seed=23)
    cache.decode(q[:1], k[:1], v[:1])
    with pytest.raises(TypeError, match=r"^q must have the cache's dtype bfloat16 \(uint16 bit "
                                        r"patterns\) \(got float32\)"):
        cache.decode(from_bfloat16_bits(q[1:]), k[1:], v[1:])
    with pytest.raises(TypeError, match=r"^k has dtype float32 but q has bfloat16"):
        cache.decode(q[1:], from_bfloat16_bits(k[1:]), v[1:])
    with pytest.raises(ValueError, match=r"^KvCache::decode: q.tokens must equal k.tokens"):
        cache.decode(q, k[1:], v[1:])
    shared = np.zeros((1, 2, 4), np.uint16)
    with pytest.raises(ValueError, match=r"^KvCache::decode: out overlaps q"):
        cache.decode(shared, k[1:], v[1:], out=shared[:, :, :3])
    with pytest.raises(ValueError, match=r"^out must have shape \(1, 2, 3\)"):
        cache.decode(q[1:], k[1:], v[1:], out=np.empty((1, 2, 4), np.uint16))
    assert cache.position == 1 and cache.resident == 1
    cache.decode(q[1:], k[1:], v[1:])
    assert cache.position == 2


# ---------------------------------------------------------------------------------------------
# The GIL
# ---------------------------------------------------------------------------------------------

def test_the_gil_is_released_while_a_kernel_runs():
    q, k, v = random_inputs((1500, 4, 64), kv_heads=4, value_dim=64, seed=1, dtype=np.float32)
    started, done = threading.Event(), threading.Event()

    def run():
        started.set()
        plsh.exact_alibi_attention(q, k, v, causal=False)
        done.set()

    worker = threading.Thread(target=run)
    counter = 0
    worker.start()
    started.wait()
    while not done.is_set():
        counter += 1
    worker.join()
    # With the GIL held for the whole kernel (about 0.1-1 s) the loop would hardly run.
    assert counter > 1000


# ---------------------------------------------------------------------------------------------
# float16 and bfloat16 (uint16 bit patterns with bfloat16=True), computed in float32
# ---------------------------------------------------------------------------------------------

HALF_TYPES = ["float16", "bfloat16"]


def to_storage(x, storage):
    """x rounded to `storage` as the module takes it: float16, or bfloat16 bits as uint16."""
    return x.astype(np.float16) if storage == "float16" else to_bfloat16_bits(x)


def from_storage(x, storage):
    return x.astype(np.float32) if storage == "float16" else from_bfloat16_bits(x)


def assert_rounded(result, expected, storage, name):
    """`result` (in `storage`) is the float32 result `expected` rounded: within u |y| (u = 2^-11
    for float16, 2^-8 for bfloat16) plus the float32 kernel's own error, 3e-5 of the largest
    |y| (a tile copied to float32 may sum in another order), plus half float16's subnormal step."""
    x = from_storage(result, storage).astype(np.float64)
    y = expected.astype(np.float64)
    bound = UNIT_ROUNDOFF[storage] * np.abs(y) + 3e-5 * np.abs(y).max() + 2.0 ** -25
    excess = np.abs(x - y) / bound
    assert excess.max() <= 1, f"{name}: worst |x - y| / bound {excess.max()}"


@pytest.mark.parametrize("storage", HALF_TYPES)
@pytest.mark.parametrize("name", FORWARDS)
def test_half_forward_is_the_float32_kernel_on_rounded_inputs(name, storage, inputs):
    stored = [to_storage(x, storage) for x in inputs]
    rounded = [from_storage(x, storage) for x in stored]
    bfloat16 = storage == "bfloat16"
    for options in (dict(query_position=4), dict(causal=False, key_position=3)):
        result = call_forward(name, *stored, bfloat16=bfloat16, **options)
        assert result.dtype == stored[0].dtype and result.shape == (2, 40, 4, 6)
        assert_rounded(result, call_forward(name, *rounded, **options), storage, name)
        out = np.zeros_like(result)
        call_forward(name, *stored, bfloat16=bfloat16, out=out, **options)
        np.testing.assert_array_equal(out, result)


@pytest.mark.parametrize("storage", HALF_TYPES)
@pytest.mark.parametrize("method", ["exact", "plsh", "fixed"])
def test_half_backward_is_the_float32_kernel_on_rounded_inputs(method, storage, inputs):
    backward = {"exact": lambda *a, **o: plsh.exact_alibi_attention_backward(*a, **o),
                "plsh": lambda *a, **o: plsh.plsh_attention_backward(*a, samples=5, seed=2, **o),
                "fixed": lambda *a, **o: plsh.fixed_block_attention_backward(*a, 8, **o)}[method]
    out = plsh.exact_alibi_attention(*inputs)  # any out exercises the same arithmetic
    dout = np.random.default_rng(5).standard_normal(out.shape)
    stored = [to_storage(x, storage) for x in (*inputs, out, dout)]
    rounded = [from_storage(x, storage) for x in stored]
    grads = backward(*stored, query_position=6, bfloat16=storage == "bfloat16")
    expected = backward(*rounded, query_position=6)
    for name, result, reference in zip(("dq", "dk", "dv"), grads, expected):
        assert result.dtype == stored[0].dtype and result.shape == reference.shape
        assert_rounded(result, reference, storage, name)


@pytest.mark.parametrize("storage", HALF_TYPES)
def test_half_error_against_float32_inputs(storage):
    """Inputs rounded from float32: relative error against the float32 result. Rounding errs by
    at most u, u/sqrt(3) rms; the logits scale q.k (q with variance 4, k 1, scale 1/sqrt(d)) move
    by sqrt(2 * 4) u/sqrt(3) = 1.6u rms, v and out add u/sqrt(3) each: about 1.8u, bound 4u."""
    q, k, v = random_inputs((1, 256, 4, 32), kv_heads=2, value_dim=32, seed=7, dtype=np.float32)
    expected = plsh.exact_alibi_attention(q, k, v)
    result = plsh.exact_alibi_attention(*(to_storage(x, storage) for x in (q, k, v)),
                                        bfloat16=storage == "bfloat16")
    error = (np.linalg.norm(from_storage(result, storage) - expected) /
             np.linalg.norm(expected))
    assert error <= 4 * UNIT_ROUNDOFF[storage], f"{error / UNIT_ROUNDOFF[storage]} u"
