"""Tests of plsh.AlibiKvCache and plsh.torch.AlibiKvCache: decoding against exact ALiBi over the
whole prefix (equal while every key is kept, within 2 bound max|v| after eviction), the bound
against the weight of the dropped keys computed densely in float64, a sudden large query
(reported, and raised in strict mode), the window formula, and errors."""

import math

import numpy as np
import pytest

import plsh
from conftest import alibi_log_factor, reference_attention

SLOPES = [0.5, 0.25, 0.125, 0.0625]


def uniform_inputs(n, heads, kv_heads, dim, value_dim, seed, dtype=np.float32):
    """q, k, v uniform in [-1, 1]: |scale| |q| |k| <= sqrt(dim), the declaration they satisfy."""
    rng = np.random.default_rng(seed)
    q = rng.uniform(-1, 1, (n, heads, dim))
    k = rng.uniform(-1, 1, (n, kv_heads, dim))
    v = rng.uniform(-1, 1, (n, kv_heads, value_dim))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def dropped_weight(q, k, cache, t, h):
    """The exact-ALiBi weight, over positions 0 .. t, of the keys the row at t of head h did not
    attend (before its kv head's window and not pinned), in float64."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    g = h // (heads // kv_heads)
    j = np.arange(t + 1)
    logits = (q[t, h].astype(np.float64) @ k[: t + 1, g].astype(np.float64).T) / math.sqrt(dim)
    logits -= cache.alibi_slopes[h] * (t - j)
    weights = np.exp(logits - logits.max())
    dropped = (j < cache.oldest_position(g)) & ~np.isin(j, cache.pinned_positions(g))
    return weights[dropped].sum() / weights.sum()


def test_alibi_kv_cache_equals_exact_alibi_while_every_key_is_kept():
    n, heads, kv_heads, dim, value_dim = 40, 4, 2, 8, 5
    q, k, v = uniform_inputs(n, heads, kv_heads, dim, value_dim, seed=3, dtype=np.float64)
    cache = plsh.AlibiKvCache(heads, kv_heads, dim, value_dim, SLOPES, tolerance=1e-6,
                              max_score=math.sqrt(dim), min_logit=-math.sqrt(dim),
                              dtype=np.float64)
    assert all(window > n for window in cache.windows)
    outputs = [cache.decode(q[t:t + 1], k[t:t + 1], v[t:t + 1]) for t in range(n)]
    assert cache.bound == 0 and cache.certified
    expected = plsh.exact_alibi_attention(q, k, v, SLOPES)
    np.testing.assert_allclose(np.concatenate(outputs), expected, rtol=0, atol=1e-12)
    assert cache.resident == n and cache.resident_per_head == [n, n]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("sinks", [0, 2])
def test_alibi_kv_cache_at_tolerance_is_within_its_bound(dtype, sinks):
    n, heads, kv_heads, dim, value_dim = 400, 4, 2, 8, 5
    q, k, v = uniform_inputs(n, heads, kv_heads, dim, value_dim, seed=5, dtype=dtype)
    tolerance = 1e-3
    cache = plsh.AlibiKvCache(heads, kv_heads, dim, value_dim, SLOPES, tolerance=tolerance,
                              max_score=math.sqrt(dim), min_logit=-math.sqrt(dim), sinks=sinks,
                              dtype=dtype)
    windows = [plsh.alibi_cache_window(SLOPES[2 * g + 1], tolerance=tolerance,
                                       max_score=math.sqrt(dim), min_logit=-math.sqrt(dim))
               for g in range(kv_heads)]
    assert cache.windows == windows
    exact = plsh.exact_alibi_attention(q, k, v, SLOPES)
    rounding = 1e-12 if dtype == np.float64 else 1e-5
    for start in range(0, n, 3):
        stop = min(n, start + 3)
        out = cache.decode(q[start:stop], k[start:stop], v[start:stop])
        assert cache.certified and cache.bound <= tolerance
        bounds = cache.bounds
        assert bounds.shape == (stop - start, heads) and bounds.max() == cache.bound
        max_v = np.abs(v[:stop]).max()
        allowed = 2 * bounds[:, :, None] * max_v + rounding
        assert np.all(np.abs(out - exact[start:stop]) <= allowed)
        for r in range(stop - start):
            for h in range(heads):
                assert bounds[r, h] >= dropped_weight(q, k, cache, start + r, h)
        for g in range(kv_heads):
            assert cache.resident_per_head[g] <= windows[g] + 3 - 1 + sinks
            assert len(cache.pinned_positions(g)) <= sinks
    assert cache.oldest_position(1) > 0  # keys were dropped


def test_alibi_kv_cache_reports_a_sudden_large_query_and_raises_in_strict_mode():
    n, heads, kv_heads, dim, value_dim = 300, 2, 1, 8, 4
    q, k, v = uniform_inputs(n, heads, kv_heads, dim, value_dim, seed=7, dtype=np.float64)
    large = 250
    q[large, 0] = 1000 * k[20, 0]  # key 20 is long dropped; in exact ALiBi it takes the row
    options = dict(tolerance=1e-4, max_score=math.sqrt(dim), min_logit=-math.sqrt(dim), sinks=0,
                   dtype=np.float64)
    cache = plsh.AlibiKvCache(heads, kv_heads, dim, value_dim, [0.25, 0.125], **options)
    for t in range(large):
        cache.decode(q[t:t + 1], k[t:t + 1], v[t:t + 1])
        assert cache.certified
    cache.decode(q[large:large + 1], k[large:large + 1], v[large:large + 1])
    truth = dropped_weight(q, k, cache, large, 0)
    assert truth > 0.9
    assert not cache.certified and cache.bound >= truth
    strict = plsh.AlibiKvCache(heads, kv_heads, dim, value_dim, [0.25, 0.125], strict=True,
                               **options)
    for t in range(large):
        strict.decode(q[t:t + 1], k[t:t + 1], v[t:t + 1])
    with pytest.raises(plsh.CertificateError, match="tolerance"):
        strict.decode(q[large:large + 1], k[large:large + 1], v[large:large + 1])
    assert isinstance(plsh.CertificateError("x"), RuntimeError)
    assert strict.position == large + 1 and not strict.certified and strict.bound >= truth


def test_alibi_cache_window_and_errors():
    window = plsh.alibi_cache_window(1 / 256, tolerance=1e-4, max_score=8, min_logit=-8)
    assert window == math.ceil(256 * math.log1p(math.exp(16) / 1e-4))
    assert plsh.alibi_cache_window(0.0) == 2 ** 63 - 1
    with pytest.raises(ValueError, match="tolerance"):
        plsh.AlibiKvCache(2, 1, 4, 4, tolerance=2.0)
    with pytest.raises(ValueError, match="min_logit"):
        plsh.AlibiKvCache(2, 1, 4, 4, max_score=1.0, min_logit=2.0)
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        plsh.AlibiKvCache(3, 2, 4, 4)
    cache = plsh.AlibiKvCache(2, 1, 4, 3)
    assert cache.options["tolerance"] == 1e-4 and cache.options["sinks"] == 4
    k = np.ones((3, 1, 4), np.float32)
    v = np.ones((3, 1, 3), np.float32)
    cache.append(k, v)
    out = np.empty((2, 2, 3), np.float32)
    assert cache.attend(np.ones((2, 2, 4), np.float32), out=out) is out
    np.testing.assert_allclose(out, 1.0)
    with pytest.raises(TypeError, match="dtype float32"):
        cache.append(k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(ValueError, match="must not exceed the tokens of the last append"):
        cache.attend(np.ones((4, 2, 4), np.float32))
    assert cache.position == 3


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_torch_alibi_kv_cache(layout):
    torch = pytest.importorskip("torch")
    import plsh.torch as pt

    n, heads, kv_heads, dim = 200, 4, 2, 8
    q, k, v = uniform_inputs(n, heads, kv_heads, dim, dim, seed=9, dtype=np.float32)
    options = dict(tolerance=1e-3, max_score=math.sqrt(dim), min_logit=-math.sqrt(dim), sinks=1)
    cache = pt.AlibiKvCache(heads, kv_heads, dim, alibi_slopes=SLOPES, layout=layout, **options)
    expected = reference_attention(q, k, v, alibi_log_factor(SLOPES))
    outputs = []
    for t in range(n):
        tensors = [torch.from_numpy(x[t:t + 1]) for x in (q, k, v)]
        if layout == "bhtd":
            tensors = [x.transpose(0, 1) for x in tensors]
        out = cache.decode(*tensors)
        outputs.append(out.transpose(0, 1) if layout == "bhtd" else out)
        assert cache.certified and cache.bounds.shape == (1, heads)
    result = torch.cat(outputs).numpy()
    assert np.abs(result - expected).max() <= 2 * 1e-3 + 1e-5
    assert cache.oldest_position(0) > 0 and cache.resident_per_head[0] < n  # window 51
    assert "AlibiKvCache" in pt.__all__ and "windows" in repr(cache)
