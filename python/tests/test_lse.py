"""Tests of the row log-sum-exp the forwards return with return_lse=True and the backwards take as
lse= (and of the windowed kernel's kept keys, kept=): the lse against a dense NumPy log-sum-exp of
the logits in float64, every backward given them against the one that computes them, the
argument checks, and plsh.torch handing them from its forward to its backward."""

import math

import numpy as np
import pytest

import plsh
from conftest import (FORWARDS, alibi_log_factor, fixed_log_factor, random_inputs,
                      truncated_log_factor)

SLOPES = [0.5, 0.25, 0.125, 0.0625]
TOLERANCE = 1e-3  # windowed
FACTOR_TOLERANCE = 0.05  # truncated
BLOCK_SIZE = 8  # fixed blocks
DRAWS = dict(samples=6, seed=3, sampling="latin_hypercube", near_field=0.1)
BACKWARDS = {"exact_alibi_attention": plsh.exact_alibi_attention_backward,
             "windowed_alibi_attention": plsh.windowed_alibi_attention_backward,
             "truncated_alibi_attention": plsh.truncated_alibi_attention_backward,
             "plsh_attention": plsh.plsh_attention_backward,
             "fixed_block_attention": plsh.fixed_block_attention_backward}


def parameters(name):
    """The positional and keyword arguments after q, k, v (after dout for a backward) of `name`."""
    return {"exact_alibi_attention": ((SLOPES,), {}),
            "windowed_alibi_attention": ((SLOPES, TOLERANCE), {}),
            "truncated_alibi_attention": ((SLOPES, FACTOR_TOLERANCE), {}),
            "plsh_attention": ((SLOPES,), DRAWS),
            "fixed_block_attention": ((BLOCK_SIZE,), {})}[name]


def forward(name, q, k, v, **options):
    arguments, keywords = parameters(name)
    return getattr(plsh, name)(q, k, v, *arguments, **keywords, **options)


def backward(name, q, k, v, out, dout, **options):
    arguments, keywords = parameters(name)
    return BACKWARDS[name](q, k, v, out, dout, *arguments, **keywords, **options)


def log_factor(name):
    """log F_h(i, j) of the logits of `name` (conftest), with Positional LSH's log c = log(c/s) +
    log s."""
    if name in ("exact_alibi_attention", "windowed_alibi_attention"):
        return alibi_log_factor(SLOPES)
    if name == "truncated_alibi_attention":
        return truncated_log_factor(SLOPES, FACTOR_TOLERANCE)
    if name == "fixed_block_attention":
        return fixed_log_factor(BLOCK_SIZE)
    counted = alibi_log_factor(SLOPES, **DRAWS)
    return lambda h, i, j: counted(h, i, j) + math.log(DRAWS["samples"])


def reference_lse(q, k, factor, causal=True, query_position=0, key_position=0):
    """The dense float64 row log-sum-exp [.., H, n_q] of the logits q.k / sqrt(d) + factor(h, i,
    j) (causal: j <= i), -inf for a row without a visible key; q, k [.., n, H, d]."""
    q, k = (np.asarray(x, dtype=np.float64) for x in (q, k))
    if q.ndim == 4:
        return np.stack([reference_lse(q[b], k[b], factor, causal, query_position, key_position)
                         for b in range(q.shape[0])])
    n_q, heads, dim = q.shape
    i = query_position + np.arange(n_q)[:, None]
    j = key_position + np.arange(k.shape[0])[None, :]
    lse = np.empty((heads, n_q))
    for h in range(heads):
        g = h // (heads // k.shape[1])
        logits = q[:, h] @ k[:, g].T / math.sqrt(dim) + factor(h, i, j)
        if causal:
            logits = np.where(j > i, -np.inf, logits)
        top = logits.max(axis=1)
        shift = np.where(np.isfinite(top), top, 0.0)
        with np.errstate(divide="ignore"):
            lse[h] = shift + np.log(np.exp(logits - shift[:, None]).sum(axis=1))
    return lse


def relative_difference(a, b):
    """max |a - b| / max(1, |b|) over the entries, equal infinities counting as 0."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    same = (a == b)
    with np.errstate(invalid="ignore"):
        difference = np.where(same, 0.0, np.abs(a - b) / np.maximum(1.0, np.abs(b)))
    return difference.max()


@pytest.mark.parametrize("name", FORWARDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_the_lse_is_the_dense_row_log_sum_exp(name, dtype, causal):
    # Grouped heads, more keys than queries, offsets, batch 2.
    q, k, v = random_inputs((2, 30, 4, 8), kv_heads=2, value_dim=5, n_k=45, seed=5, dtype=dtype)
    positions = dict(query_position=15, key_position=0)
    out, lse, *kept = forward(name, q, k, v, causal=causal, return_lse=True, **positions)
    assert lse.shape == (2, 4, 30) and lse.dtype == dtype
    assert len(kept) == (1 if name == "windowed_alibi_attention" else 0)
    # The output is the one without return_lse.
    assert np.array_equal(out, forward(name, q, k, v, causal=causal, **positions))
    expected = reference_lse(q, k, log_factor(name), causal, **positions)
    # The windowed kernel drops keys of total weight at most the tolerance.
    allowed = {np.float64: 1e-12, np.float32: 2e-5}[dtype]
    if name == "windowed_alibi_attention":
        allowed = 2 * TOLERANCE
    assert relative_difference(lse, expected) <= allowed


@pytest.mark.parametrize("name", FORWARDS)
def test_the_lse_is_heads_by_tokens_in_either_layout_and_rank(name):
    q, k, v = random_inputs((2, 20, 4, 8), kv_heads=2, value_dim=5, seed=6)
    _, lse, *_ = forward(name, q, k, v, return_lse=True)
    swapped = [x.swapaxes(1, 2) for x in (q, k, v)]
    _, lse_bhtd, *_ = forward(name, *swapped, layout="bhtd", return_lse=True)
    assert np.array_equal(lse_bhtd, lse)
    _, lse_single, *_ = forward(name, q[1], k[1], v[1], return_lse=True)
    assert lse_single.shape == (4, 20) and np.array_equal(lse_single, lse[1])


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_the_lse_of_16_bit_arrays_is_float32(storage):
    q, k, v = random_inputs((20, 2, 8), kv_heads=2, value_dim=8, seed=7, dtype=np.float32)
    if storage == "float16":
        arrays, options = [x.astype(np.float16) for x in (q, k, v)], {}
    else:
        arrays = [(x.view(np.uint32) >> 16).astype(np.uint16) for x in (q, k, v)]
        options = dict(dtype="bfloat16")
    out, lse = plsh.exact_alibi_attention(*arrays, return_lse=True, **options)
    assert lse.dtype == np.float32 and lse.shape == (2, 20)
    grads = plsh.exact_alibi_attention_backward(*arrays, out, out, lse=lse, **options)
    expected = plsh.exact_alibi_attention_backward(*arrays, out, out, **options)
    for grad, reference in zip(grads, expected):
        assert grad.dtype == reference.dtype
        assert relative_difference(grad.astype(np.float32), reference.astype(np.float32)) < 1e-2


def test_rows_that_see_no_key_have_lse_minus_infinity_and_zero_gradients():
    q, k, v = random_inputs((12, 4, 4), kv_heads=2, value_dim=4, seed=8)
    for name in FORWARDS:
        # Causal, every key after every query.
        out, lse, *kept = forward(name, q, k, v, key_position=100, return_lse=True)
        assert np.all(lse == -np.inf), name
        extra = dict(kept=kept[0]) if kept else {}
        grads = backward(name, q, k, v, out, np.ones_like(out), key_position=100, lse=lse,
                         **extra)
        assert all(np.all(grad == 0) for grad in grads), name


@pytest.mark.parametrize("name", FORWARDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_the_backward_given_the_lse_equals_the_backward_without(name, dtype, layout):
    q, k, v = random_inputs((2, 70, 4, 8), kv_heads=2, value_dim=5, seed=9, dtype=dtype)
    if layout == "bhtd":
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
    options = dict(query_position=3, key_position=1, layout=layout)
    out, lse, *kept = forward(name, q, k, v, return_lse=True, **options)
    dout = np.random.default_rng(10).standard_normal(out.shape).astype(dtype)
    computed = backward(name, q, k, v, out, dout, **options)
    given = backward(name, q, k, v, out, dout, lse=lse, **options)
    tolerance = {np.float64: 1e-12, np.float32: 1e-4}[dtype]
    for a, b in zip(given, computed):
        assert a.dtype == dtype and a.shape == b.shape
        assert np.abs(a - b).max() <= tolerance * max(1.0, np.abs(b).max())
    # A non-contiguous lse is read through a copy.
    strided = backward(name, q, k, v, out, dout, lse=np.asfortranarray(lse), **options)
    for a, b in zip(strided, given):
        assert np.array_equal(a, b)
    if name == "windowed_alibi_attention":
        # The kept keys are the certificate's: the same bits without and with the lse.
        for a, b in zip(backward(name, q, k, v, out, dout, kept=kept[0], **options), computed):
            assert np.array_equal(a, b)
        for a, b in zip(backward(name, q, k, v, out, dout, lse=lse, kept=kept[0], **options),
                        given):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("name", FORWARDS)
def test_an_lse_of_another_shape_dtype_or_type_is_rejected(name):
    q, k, v = random_inputs((2, 16, 4, 8), kv_heads=2, value_dim=8, seed=11, dtype=np.float32)
    out, lse, *_ = forward(name, q, k, v, return_lse=True)
    function = name + "_backward"
    for wrong in (lse[:, :, :-1], lse[0], lse.swapaxes(1, 2), np.zeros((2, 4, 16, 1), np.float32)):
        with pytest.raises(ValueError, match=rf"{function}: lse must have shape \(2, 4, 16\)"):
            backward(name, q, k, v, out, out, lse=np.ascontiguousarray(wrong))
    with pytest.raises(TypeError, match=f"{function}: lse must have dtype float32"):
        backward(name, q, k, v, out, out, lse=lse.astype(np.float64))
    with pytest.raises(TypeError, match=f"{function}: lse must be a numpy.ndarray"):
        backward(name, q, k, v, out, out, lse=lse.tolist())
    # float64 arrays take a float64 lse.
    q64, k64, v64, out64 = (x.astype(np.float64) for x in (q, k, v, out))
    with pytest.raises(TypeError, match="float64, the compute type of float64"):
        backward(name, q64, k64, v64, out64, out64, lse=lse)


def test_kept_keys_of_another_call_or_type_are_rejected():
    q, k, v = random_inputs((2, 100, 4, 4), kv_heads=2, value_dim=4, seed=12)
    name, function = "windowed_alibi_attention", "windowed_alibi_attention_backward"
    out, lse, kept = forward(name, q, k, v, return_lse=True)
    assert isinstance(kept, plsh.KeptKeys) and not kept.empty
    with pytest.raises(TypeError, match=f"{function}: kept must be the plsh.KeptKeys"):
        backward(name, q, k, v, out, out, kept=lse)
    with pytest.raises(ValueError, match=f"{function}.*kept holds no ranges"):
        backward(name, q, k, v, out, out, kept=plsh.KeptKeys())
    with pytest.raises(ValueError, match=f"{function}.*kept comes from a call with tolerance"):
        plsh.windowed_alibi_attention_backward(q, k, v, out, out, SLOPES, 1e-2, kept=kept)
    _, _, shorter = forward(name, q[:, :50], k[:, :50], v[:, :50], return_lse=True)
    with pytest.raises(ValueError, match=f"{function}.*kept comes from a call with batch"):
        backward(name, q, k, v, out, out, kept=shorter)


def test_return_lse_false_returns_the_output_alone():
    q, k, v = random_inputs((10, 4, 4), kv_heads=2, value_dim=4, seed=13)
    for name in FORWARDS:
        out = forward(name, q, k, v)
        assert isinstance(out, np.ndarray)
        assert np.array_equal(forward(name, q, k, v, return_lse=False), out)
        result = forward(name, q, k, v, out=np.empty_like(out), return_lse=True)
        assert np.array_equal(result[0], out)
