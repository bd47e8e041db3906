"""Tests of truncated ALiBi from Python: the NumPy kernels at the edges of the band (tolerance 0 is
exact ALiBi bit for bit, tolerance 1 keeps the diagonal only, keys outside every band get no
gradient whatever their values), their argument checks, and plsh.torch.truncated_alibi_attention
against a dense PyTorch reference, bit for bit against the NumPy kernels, with gradcheck in float64
in both layouts, and its argument errors. The forward and backward against the dense NumPy
references are in test_kernels.py."""

import math

import numpy as np
import pytest

import plsh
from conftest import random_inputs

SLOPES = [0.5, 0.25, 0.1, 0.0]


def test_truncated_at_tolerance_0_is_exact_alibi_bit_for_bit(inputs):
    q, k, v = inputs
    dout = np.random.default_rng(21).standard_normal(q.shape[:-1] + v.shape[-1:])
    for causal in (True, False):
        options = dict(causal=causal, query_position=5, key_position=2)
        exact = plsh.exact_alibi_attention(q, k, v, SLOPES, **options)
        out = plsh.truncated_alibi_attention(q, k, v, SLOPES, 0.0, **options)
        np.testing.assert_array_equal(out, exact)
        expected = plsh.exact_alibi_attention_backward(q, k, v, exact, dout, SLOPES, **options)
        grads = plsh.truncated_alibi_attention_backward(q, k, v, out, dout, SLOPES, 0.0,
                                                        **options)
        for got, want in zip(grads, expected):
            np.testing.assert_array_equal(got, want)


def test_truncated_drops_keys_and_differs_from_exact_alibi(inputs):
    q, k, v = inputs
    exact = plsh.exact_alibi_attention(q, k, v, SLOPES)
    out = plsh.truncated_alibi_attention(q, k, v, SLOPES, 0.1)
    # Heads 0 to 2 keep 4, 9 and 23 keys back; head 3 (slope 0) keeps every key.
    assert np.abs(out[..., :3, :] - exact[..., :3, :]).max() > 1e-3
    np.testing.assert_array_equal(out[..., 3, :], exact[..., 3, :])


def test_truncated_at_tolerance_1_keeps_the_diagonal_only():
    # One visible key per query: out_i = v_i, dv_j sums dout over the query heads of j's group,
    # dq and dk vanish (up to the rounding of dP - D); queries past the last key see nothing.
    q, k, v = random_inputs((30, 4, 6), kv_heads=2, value_dim=5, n_k=25, seed=22)
    dout = np.random.default_rng(23).standard_normal((30, 4, 5))
    slopes = [0.5, 0.25, 0.1, 0.05]
    out = plsh.truncated_alibi_attention(q, k, v, slopes, 1.0, causal=False)
    expected = np.zeros((30, 4, 5))
    expected[:25] = np.repeat(v, 2, axis=1)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-15)
    dq, dk, dv = plsh.truncated_alibi_attention_backward(q, k, v, out, dout, slopes, 1.0,
                                                         causal=False)
    assert np.abs(dq).max() <= 1e-14 and np.abs(dk).max() <= 1e-14
    np.testing.assert_allclose(dv, dout[:25].reshape(25, 2, 2, 5).sum(axis=2), rtol=0,
                               atol=1e-14)


def test_keys_outside_every_band_get_no_gradient_whatever_their_values():
    # Queries at 100..119 against keys 0..199; bands of 7 and 46 positions at 0.1: no query sees
    # the keys 0..53 and 166..199, which hold NaN and infinities.
    q, k, v = random_inputs((20, 2, 8), kv_heads=1, value_dim=5, n_k=200, seed=24)
    dout = np.random.default_rng(25).standard_normal((20, 2, 5))
    options = dict(causal=False, query_position=100)
    slopes = [0.3, 0.05]
    out = plsh.truncated_alibi_attention(q, k, v, slopes, 0.1, **options)
    clean = plsh.truncated_alibi_attention_backward(q, k, v, out, dout, slopes, 0.1, **options)
    outside = np.r_[0:54, 166:200]
    k[outside], v[outside] = np.nan, np.inf
    np.testing.assert_array_equal(plsh.truncated_alibi_attention(q, k, v, slopes, 0.1, **options),
                                  out)
    poisoned = plsh.truncated_alibi_attention_backward(q, k, v, out, dout, slopes, 0.1, **options)
    for got, want in zip(poisoned, clean):
        np.testing.assert_array_equal(got, want)
    assert not clean[1][outside].any() and not clean[2][outside].any()
    assert clean[1][54].any()


@pytest.mark.parametrize("factor_tolerance", [-0.1, 1.5, float("nan"), float("inf")])
def test_a_factor_tolerance_outside_zero_one_is_rejected(factor_tolerance, inputs):
    q, k, v = inputs
    out = plsh.exact_alibi_attention(q, k, v)
    with pytest.raises(ValueError, match=r"^truncated_alibi_attention: factor_tolerance must lie "
                                         r"in \[0, 1\]"):
        plsh.truncated_alibi_attention(q, k, v, None, factor_tolerance)
    with pytest.raises(ValueError, match=r"^truncated_alibi_attention_backward: factor_tolerance "
                                         r"must lie in \[0, 1\]"):
        plsh.truncated_alibi_attention_backward(q, k, v, out, out, None, factor_tolerance)


def test_truncated_arguments_are_checked_like_the_other_kernels(inputs):
    q, k, v = inputs
    out = plsh.exact_alibi_attention(q, k, v)
    with pytest.raises(TypeError):
        plsh.truncated_alibi_attention(q, k, v, None)  # factor_tolerance is required
    with pytest.raises(TypeError):
        plsh.truncated_alibi_attention(q, k, v, None, 0.1, False)  # causal is keyword-only
    with pytest.raises(ValueError, match="alibi_slopes has 3 entries but q has 4 heads"):
        plsh.truncated_alibi_attention(q, k, v, [0.5, 0.25, 0.1], 0.1)
    with pytest.raises(ValueError, match="slopes"):
        plsh.truncated_alibi_attention(q, k, v, [0.5, -1.0, 0.1, 0.0], 0.1)
    with pytest.raises(ValueError, match="query_position"):
        plsh.truncated_alibi_attention_backward(q, k, v, out, out, None, 0.1, query_position=-1)
    with pytest.raises(ValueError, match="dk overlaps dq"):
        dq = np.zeros_like(q)
        plsh.truncated_alibi_attention_backward(q, k, v, out, out, None, 0.1, dq=dq,
                                                dk=dq[:, :, :2], dv=np.zeros_like(v))


torch = pytest.importorskip("torch")
import plsh.torch as pt  # noqa: E402


def dense_truncated(q, k, v, slopes, factor_tolerance, causal=True, softmax_scale=None,
                    query_position=0, key_position=0):
    """ALiBi truncated as a PyTorch user writes it, [B, T, H, D]: softmax(q k^T scale - m |i - j|)
    v over |i - j| <= floor(ln(1/factor_tolerance) / m); a row without keys is zeros."""
    heads, kv_heads = q.shape[-2], k.shape[-2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qh = q.transpose(-2, -3)
    kh = k.transpose(-2, -3).repeat_interleave(heads // kv_heads, dim=-3)
    vh = v.transpose(-2, -3).repeat_interleave(heads // kv_heads, dim=-3)
    distance = (query_position + torch.arange(q.shape[-3])[:, None]
                - key_position - torch.arange(k.shape[-3])[None, :])
    m = torch.tensor(slopes, dtype=q.dtype)[:, None, None]
    band = torch.tensor([math.inf if s == 0 else math.floor(math.log(1 / factor_tolerance) / s)
                         for s in slopes], dtype=q.dtype)[:, None, None]
    scores = qh @ kh.transpose(-1, -2) * scale - m * distance.abs().to(q.dtype)
    hidden = distance.abs().to(q.dtype) > band
    if causal:
        hidden = hidden | (distance < 0)
    weights = torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1)
    weights = weights.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)  # no NaN rows
    return (weights @ vh).transpose(-2, -3)


def torch_inputs(batch=2, n=24, heads=4, kv_heads=2, dim=8, value_dim=6, n_k=None, seed=0,
                 dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    n_k = n if n_k is None else n_k
    shapes = [(batch, n, heads, dim), (batch, n_k, kv_heads, dim),
              (batch, n_k, kv_heads, value_dim)]
    return [torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()
            for shape in shapes]


@pytest.mark.parametrize("options", [dict(causal=True, query_position=7, key_position=2),
                                     dict(causal=False, softmax_scale=0.6, query_position=0,
                                          key_position=9)])
@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_torch_truncated_values_and_gradients_against_dense_pytorch(options, layout):
    q, k, v = torch_inputs(seed=26, n_k=30)
    slopes = [0.5, 0.25, 0.1, 0.0]
    reference = dense_truncated(q, k, v, slopes, 0.1, **options)
    inputs = (q, k, v) if layout == "bthd" else [t.transpose(1, 2) for t in (q, k, v)]
    out = pt.truncated_alibi_attention(*inputs, slopes, 0.1, layout=layout, **options)
    if layout == "bhtd":
        out = out.transpose(1, 2)
    assert torch.allclose(out, reference, rtol=0, atol=1e-12)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(27),
                          dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for grad, reference_grad in zip(grads, expected):
        assert torch.allclose(grad, reference_grad, rtol=0, atol=1e-11)


def test_torch_truncated_equals_the_numpy_kernels_bit_for_bit():
    q, k, v = torch_inputs(dtype=torch.float32, seed=28)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(29))
    options = dict(causal=True, query_position=7, key_position=2)
    out = pt.truncated_alibi_attention(q, k, v, None, 0.05, **options)
    expected, lse = plsh.truncated_alibi_attention(*arrays, None, 0.05, return_lse=True,
                                                   **options)
    assert out.dtype == torch.float32 and np.array_equal(out.detach().numpy(), expected)
    # The backward of plsh.torch is the C++ backward given the forward's row log-sum-exp.
    grads = plsh.truncated_alibi_attention_backward(*arrays, expected, dout.numpy(), None, 0.05,
                                                    lse=lse, **options)
    out.backward(dout)
    for tensor, grad in zip((q, k, v), grads):
        assert np.array_equal(tensor.grad.numpy(), grad)


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_truncated_gradcheck(layout, causal):
    # Grouped heads, offsets, bands of 1, 2 and 4 positions at tolerance 0.5 and one of slope 0.
    q, k, v = torch_inputs(batch=2, n=7, heads=4, kv_heads=2, dim=3, value_dim=2, n_k=9, seed=30)
    if layout == "bhtd":
        q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    slopes = [0.5, 0.3, 0.15, 0.0]
    assert torch.autograd.gradcheck(
        lambda q, k, v: pt.truncated_alibi_attention(q, k, v, slopes, 0.5, causal=causal,
                                                     softmax_scale=0.7, query_position=5,
                                                     key_position=1, layout=layout),
        (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_torch_truncated_errors():
    q, k, v = torch_inputs(seed=31)
    with pytest.raises(ValueError, match="truncated_alibi_attention: factor_tolerance must lie"):
        pt.truncated_alibi_attention(q, k, v, None, 1.5)
    with pytest.raises(TypeError):
        pt.truncated_alibi_attention(q, k, v, None)  # factor_tolerance is required
    with pytest.raises(TypeError):
        pt.truncated_alibi_attention(q, k, v, None, 0.1, True)  # causal is keyword-only
    with pytest.raises(ValueError, match="layout"):
        pt.truncated_alibi_attention(q, k, v, None, 0.1, layout="tbhd")
    with pytest.raises(ValueError, match="alibi_slopes has 2 entries but q has 4 heads"):
        pt.truncated_alibi_attention(q, k, v, [0.5, 0.1], 0.1)
    with pytest.raises(TypeError, match="k has dtype torch.float32 but q has torch.float64"):
        pt.truncated_alibi_attention(q, k.float(), v, None, 0.1)
