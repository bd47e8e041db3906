"""Tests of plsh.KvCache: decoding against the full forward, decode against append then attend,
the 16-bit caches, out= and errors."""

import numpy as np
import pytest

import plsh
from conftest import (assert_rounded, from_bfloat16_bits, from_storage, random_inputs, same_bin,
                      to_bfloat16_bits)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("sampling", ["independent", "latin_hypercube"])
@pytest.mark.parametrize("near_field", [0.0, 0.2])
def test_kv_cache_decode_equals_the_full_forward(dtype, chunk, sampling, near_field):
    n, heads, kv_heads, dim, value_dim = 60, 4, 2, 8, 5
    q, k, v = random_inputs((n, heads, dim), kv_heads=kv_heads, value_dim=value_dim, seed=12,
                            dtype=dtype)
    slopes = [0.3, 0.2, 0.1, 0.05]
    estimator = dict(samples=8, seed=6, sampling=sampling, near_field=near_field)
    full = plsh.plsh_attention(q, k, v, slopes, key_position=0, **estimator)
    cache = plsh.KvCache(heads, kv_heads, dim, value_dim, slopes, dtype=dtype, **estimator)
    assert cache.dtype == np.dtype(dtype)
    assert cache.options["near_field"] == near_field
    outputs = []
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        cache.append(k[start:stop], v[start:stop])
        assert cache.position == stop
        assert cache.oldest_position == cache.position - cache.resident
        outputs.append(cache.attend(q[start:stop]))
    if near_field > 0:
        # The near field of the slope-0.05 head reaches floor(ln 5 / 0.05) = 32 positions back.
        assert cache.resident >= 33
    elif sampling == "independent":
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
    with pytest.raises(TypeError, match=r'^dtype must be numpy.float32, numpy.float64, numpy.float16 or "bfloat16" '
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
