"""Tests of windowed ALiBi from Python: the guarantee against exact ALiBi (forward and backward),
an attention sink far back, and plsh.torch's autograd function and module method."""

import numpy as np
import pytest

import plsh
from conftest import random_inputs

# Steep heads on 300 tokens: the later query tiles drop the first keys.
SLOPES = [1.0, 0.5, 0.25, 0.125]


def test_windowed_output_is_within_twice_the_tolerance_of_exact_alibi():
    q, k, v = random_inputs((300, 4, 8), kv_heads=2, value_dim=5, seed=11, query_amplitude=2.0)
    for causal in (True, False):
        exact = plsh.exact_alibi_attention(q, k, v, SLOPES, causal=causal)
        for tolerance in (1e-1, 1e-3, 1e-6):
            out = plsh.windowed_alibi_attention(q, k, v, SLOPES, tolerance, causal=causal)
            error = np.abs(out - exact).max()
            assert error <= 2 * tolerance * np.abs(v).max() + 1e-12, (causal, tolerance, error)
        # The kernel does drop keys here, or the bound above would say nothing.
        assert np.abs(plsh.windowed_alibi_attention(q, k, v, SLOPES, 1e-1, causal=causal)
                      - exact).max() > 0


def test_windowed_keeps_a_far_sink():
    # Key 0 scores 30 above the others for every query: exact ALiBi weighs it e^{30 - m d}, far
    # beyond the reach of the factor e^{-m d} alone.
    q, k, v = random_inputs((600, 4, 8), kv_heads=4, value_dim=4, seed=12, query_amplitude=1.0)
    q[..., 0] = 2.0
    k[0, :, 0] = 15.0 * np.sqrt(8)
    exact = plsh.exact_alibi_attention(q, k, v, [0.25, 0.125, 0.0625, 1 / 32])
    out = plsh.windowed_alibi_attention(q, k, v, [0.25, 0.125, 0.0625, 1 / 32], 1e-6)
    assert np.abs(out - exact).max() <= 2e-6 * np.abs(v).max() + 1e-12


def test_windowed_backward_is_exact_at_tolerance_0_and_close_above():
    q, k, v = random_inputs((300, 4, 8), kv_heads=2, value_dim=5, seed=13, query_amplitude=2.0)
    dout = np.random.default_rng(14).uniform(-1, 1, size=(300, 4, 5))
    exact = plsh.exact_alibi_attention(q, k, v, SLOPES)
    expected = plsh.exact_alibi_attention_backward(q, k, v, exact, dout, SLOPES)
    out = plsh.windowed_alibi_attention(q, k, v, SLOPES, 0.0)
    for got, want in zip(plsh.windowed_alibi_attention_backward(q, k, v, out, dout, SLOPES, 0.0),
                         expected):
        np.testing.assert_array_equal(got, want)
    out = plsh.windowed_alibi_attention(q, k, v, SLOPES, 1e-4)
    grads = plsh.windowed_alibi_attention_backward(q, k, v, out, dout, SLOPES, 1e-4)
    # Per row the kept weights differ from exact ALiBi's by at most 2e-4 in sum; the gradients
    # move by a few times that relative to their scale (tests/test_windowed.cpp has the bound).
    for got, want in zip(grads, expected):
        assert got.shape == want.shape
        assert 0 < np.abs(got - want).max() <= 300 * 1e-3 * np.abs(want).max()


torch = pytest.importorskip("torch")
import plsh.torch as pt  # noqa: E402


def test_torch_windowed_equals_the_cpp_kernels_and_passes_gradcheck():
    generator = torch.Generator().manual_seed(15)
    q = (2 * torch.randn(1, 256, 2, 2, generator=generator, dtype=torch.float64)).requires_grad_()
    k = torch.randn(1, 256, 1, 2, generator=generator, dtype=torch.float64).requires_grad_()
    v = torch.randn(1, 256, 1, 2, generator=generator, dtype=torch.float64).requires_grad_()
    slopes = [2.0, 1.0]
    out = pt.windowed_alibi_attention(q, k, v, slopes, tolerance=1e-3)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    expected = plsh.windowed_alibi_attention(*arrays, slopes, 1e-3)
    assert np.array_equal(out.detach().numpy(), expected)
    # The last query tile drops keys: the function differs from exact ALiBi.
    assert not np.array_equal(expected, plsh.exact_alibi_attention(*arrays, slopes))
    assert torch.autograd.gradcheck(
        lambda q, k, v: pt.windowed_alibi_attention(q, k, v, slopes, tolerance=1e-3), (q, k, v),
        eps=1e-6, atol=1e-7, rtol=1e-5)


def test_alibi_attention_module_windowed_method():
    module = pt.AlibiAttention(4, method="windowed", tolerance=1e-3)
    assert "tolerance=0.001" in repr(module)
    q, k, v = (torch.randn(1, 100, h, 8, generator=torch.Generator().manual_seed(s))
               for h, s in ((4, 1), (2, 2), (2, 3)))
    expected = pt.windowed_alibi_attention(q, k, v, tolerance=1e-3)
    assert torch.equal(module(q, k, v), expected)
    with pytest.raises(ValueError, match="tolerance"):
        pt.AlibiAttention(4, method="windowed", tolerance=2.0)
