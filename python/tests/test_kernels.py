"""Tests of the NumPy API of plsh: the forward and backward kernels against dense references,
batches, strided arrays, out=, zero tokens, and the GIL released while a kernel runs."""

import math
import pathlib
import re
import threading

import numpy as np
import pytest

import plsh
from conftest import (FORWARDS, alibi_log_factor, call_forward, fixed_log_factor, random_inputs,
                      reference_attention, truncated_log_factor)

FORWARD_TOLERANCE = {np.float64: 1e-12, np.float32: 3e-5}

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
    def plsh_case(sampling, near_field, **kernel):
        estimator = dict(sampling=sampling, near_field=near_field)
        return (plsh.plsh_attention(q, k, v, slopes, samples=6, seed=4, **estimator, **kernel,
                                    **options),
                alibi_log_factor(slopes, 6, 4, **estimator))

    cases = {
        "exact": (plsh.exact_alibi_attention(q, k, v, slopes, **options), alibi_log_factor(slopes)),
        "fused": plsh_case("independent", 0.0),
        "passes": plsh_case("independent", 0.0, kernel="passes"),
        "fused latin": plsh_case("latin_hypercube", 0.0),
        "passes latin": plsh_case("latin_hypercube", 0.0, kernel="passes"),
        "fused near field": plsh_case("independent", 0.3),
        "fused latin near field": plsh_case("latin_hypercube", 0.05),
        "fused defaults": (plsh.plsh_attention(q, k, v, slopes, samples=6, seed=4, **options),
                           alibi_log_factor(slopes, 6, 4)),
        "fixed": (plsh.fixed_block_attention(q, k, v, 8, **options), fixed_log_factor(8)),
        # Bands of 4, 9 and 23 positions, and every key for slope 0.
        "truncated": (plsh.truncated_alibi_attention(q, k, v, slopes, 0.1, **options),
                      truncated_log_factor(slopes, 0.1)),
    }
    for name, (result, log_factor) in cases.items():
        assert result.dtype == dtype and result.shape == (2, 37, 4, 5), name
        expected = reference_attention(q, k, v, log_factor, **options)
        np.testing.assert_allclose(result, expected, rtol=0, atol=tolerance, err_msg=name)


def test_scale_and_default_slopes(inputs):
    q, k, v = inputs
    result = plsh.exact_alibi_attention(q, k, v, softmax_scale=0.3)
    expected = reference_attention(q, k, v, alibi_log_factor(plsh.alibi_slopes(4)),
                                   softmax_scale=0.3)
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
    independent = plsh.plsh_attention(q, k, v, samples=6, seed=2, sampling="independent")
    assert not np.array_equal(latin, independent)
    # samples = 1: the same grids (test_kernel_grids_follow_the_sampling), the same output.
    np.testing.assert_array_equal(
        plsh.plsh_attention(q, k, v, samples=1, seed=2, sampling="latin_hypercube"),
        plsh.plsh_attention(q, k, v, samples=1, seed=2, sampling="independent"))


def test_fused_and_passes_agree_to_rounding(inputs):
    q, k, v = (x.astype(np.float32) for x in inputs)
    fused = plsh.plsh_attention(q, k, v, samples=8, seed=2, near_field=0)
    passes = plsh.plsh_attention(q, k, v, samples=8, seed=2, near_field=0, kernel="passes")
    np.testing.assert_allclose(fused, passes, rtol=0, atol=2e-6)

# ---------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------

def reference_backward(q, k, v, dout, log_factor, causal=True, softmax_scale=None, query_position=0,
                       key_position=0):
    """Dense float64 gradients (dq, dk, dv) of reference_attention, rank 3."""
    n_q, heads, dim = q.shape
    n_k, kv_heads, _ = v.shape
    group = heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
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


@pytest.mark.parametrize("method", ["exact", "truncated", "truncated 1", "plsh", "plsh latin",
                                    "plsh latin near field"])
def test_backward_kernels_against_dense_reference(method):
    q, k, v = random_inputs((33, 4, 6), kv_heads=2, value_dim=5, n_k=40, seed=8)
    dout = np.random.default_rng(9).standard_normal((33, 4, 5))
    options = dict(causal=True, query_position=12, key_position=3, softmax_scale=0.4)
    slopes = [0.3, 0.1, 0.05, 0.0]
    if method == "exact":
        out = plsh.exact_alibi_attention(q, k, v, slopes, **options)
        grads = plsh.exact_alibi_attention_backward(q, k, v, out, dout, slopes, **options)
        log_factor = alibi_log_factor(slopes)
    elif method.startswith("truncated"):
        # 0.1: bands of 7, 23 and 46 positions; 1: each query sees the key at its own position.
        factor_tolerance = 1.0 if method == "truncated 1" else 0.1
        out = plsh.truncated_alibi_attention(q, k, v, slopes, factor_tolerance, **options)
        grads = plsh.truncated_alibi_attention_backward(q, k, v, out, dout, slopes,
                                                        factor_tolerance, **options)
        log_factor = truncated_log_factor(slopes, factor_tolerance)
    else:
        sampling = "latin_hypercube" if method.startswith("plsh latin") else "independent"
        near_field = 0.1 if method.endswith("near field") else 0.0
        estimator = dict(samples=5, seed=3, sampling=sampling, near_field=near_field)
        out = plsh.plsh_attention(q, k, v, slopes, **estimator, **options)
        grads = plsh.plsh_attention_backward(q, k, v, out, dout, slopes, **estimator, **options)
        log_factor = alibi_log_factor(slopes, **estimator)
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


@pytest.mark.parametrize("method", ["exact", "truncated", "plsh"])
def test_batched_backward_equals_per_item_calls(method, inputs):
    q, k, v = inputs
    backward = {"exact": plsh.exact_alibi_attention_backward,
                "truncated": lambda *a: plsh.truncated_alibi_attention_backward(*a, None, 0.05),
                "plsh": plsh.plsh_attention_backward}[method]
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


def test_large_new_outputs_have_the_bits_of_out_arrays_and_keep_their_memory():
    # From 4 MiB on, a new output is a mapping of its own (huge pages where the system allows):
    # the same bits as an out= array from NumPy, C-contiguous and writeable, and alive as long as
    # a view of it is.
    q, k, v = random_inputs((1, 2048, 8, 64), 8, 64, seed=5, dtype=np.float32)
    expected = np.empty_like(q)
    plsh.plsh_attention(q, k, v, out=expected)
    out = plsh.plsh_attention(q, k, v)
    assert out.nbytes == 4 << 20 and out.flags.c_contiguous and out.flags.writeable
    setting = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if setting.exists() and re.search(r"\[(always|madvise)\]", setting.read_text()):
        assert type(out.base).__name__ == "PyCapsule"  # the mapping's owner, not NumPy's memory
    np.testing.assert_array_equal(out, expected)
    dout = random_inputs((1, 2048, 8, 64), 8, 64, seed=6, dtype=np.float32)[0]
    given = [np.full_like(q, np.nan) for _ in range(3)]
    plsh.plsh_attention_backward(q, k, v, expected, dout, dq=given[0], dk=given[1], dv=given[2])
    gradients = plsh.plsh_attention_backward(q, k, v, expected, dout)
    for name, gradient, reference in zip(("dq", "dk", "dv"), gradients, given):
        assert gradient.flags.c_contiguous and gradient.flags.writeable, name
        np.testing.assert_array_equal(gradient, reference, err_msg=name)
    view = out[0, -3:]
    del out, gradients
    np.testing.assert_array_equal(view, expected[0, -3:])
    view[...] = 2.0
    assert np.all(view == 2.0)


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
             "truncated": (plsh.truncated_alibi_attention_backward, (None, 0.05)),
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
# The near field and the defaults of the estimator
# ---------------------------------------------------------------------------------------------

def test_the_defaults_are_those_of_the_cpp_options():
    assert plsh.PLSH_DEFAULTS == dict(samples=100, seed=0, sampling="latin_hypercube",
                                      near_field=0.05)
    q, k, v = random_inputs((40, 4, 8), kv_heads=2, value_dim=4, seed=12)
    np.testing.assert_array_equal(
        plsh.plsh_attention(q, k, v),
        plsh.plsh_attention(q, k, v, samples=100, seed=0, sampling="latin_hypercube",
                            near_field=0.05))


def test_the_near_field_limits():
    q, k, v = random_inputs((64, 4, 8), kv_heads=4, value_dim=4, seed=13)
    slopes = [0.5, 0.2, 0.05, 0.0]
    # A vanishing threshold reaches every key: exact ALiBi, whatever the draws.
    np.testing.assert_allclose(
        plsh.plsh_attention(q, k, v, slopes, samples=3, near_field=1e-300),
        plsh.exact_alibi_attention(q, k, v, slopes), rtol=0, atol=1e-12)
    # Threshold 1 reaches the diagonal only, which every block holds: the block estimator.
    for sampling in ("independent", "latin_hypercube"):
        np.testing.assert_allclose(
            plsh.plsh_attention(q, k, v, slopes, samples=7, sampling=sampling, near_field=1.0),
            plsh.plsh_attention(q, k, v, slopes, samples=7, sampling=sampling, near_field=0.0),
            rtol=0, atol=1e-12)


@pytest.mark.parametrize("near_field", [-0.1, 1.5, float("nan"), float("inf")])
def test_a_near_field_outside_zero_one_is_rejected(near_field):
    q, k, v = random_inputs((8, 2, 4), kv_heads=2, value_dim=4, seed=14)
    with pytest.raises(ValueError, match="near_field"):
        plsh.plsh_attention(q, k, v, near_field=near_field)
    with pytest.raises(ValueError, match="near_field"):
        plsh.KvCache(2, 2, 4, 4, near_field=near_field)


@pytest.mark.parametrize("near_field", [0.05, 0.5, 1e-3])
def test_the_pass_kernel_computes_the_near_field_estimator(near_field):
    # The defaults (near_field 0.05) and other near fields: the pass kernel gives the fused
    # kernel's output to rounding.
    q, k, v = random_inputs((40, 4, 8), kv_heads=2, value_dim=6, seed=15)
    fused = plsh.plsh_attention(q, k, v, near_field=near_field)
    passes = plsh.plsh_attention(q, k, v, near_field=near_field, kernel="passes")
    np.testing.assert_allclose(passes, fused, rtol=0, atol=1e-10)
    np.testing.assert_allclose(plsh.plsh_attention(q, k, v, kernel="passes"),
                               plsh.plsh_attention(q, k, v), rtol=0, atol=1e-10)

