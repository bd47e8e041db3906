"""Shared helpers of the plsh Python tests: seeded inputs, dense NumPy references, the forward
kernels by name, and float16/bfloat16 conversions with their rounding bound.

The references are written from the formulas, in float64, one head at a time:
ALiBi (Press et al.) softmax(scale q k^T - m |i - j|) v, causal keeping j <= i; Positional LSH
softmax(scale q k^T + log c) v with c_ij the number of draws in which positions i and j share a
bin (c = 0: masked); a row without visible keys is zero.
"""

import math

import numpy as np
import pytest

import plsh


def random_inputs(shape_q, kv_heads, value_dim, n_k=None, seed=0, dtype=np.float64,
                  query_amplitude=2.0):
    """q of shape_q ([..., n, H, d]), k [..., n_k, kv_heads, d], v [..., n_k, kv_heads, value_dim]."""
    rng = np.random.default_rng(seed)
    *batch, n, heads, dim = shape_q
    n_k = n if n_k is None else n_k
    q = query_amplitude * rng.standard_normal((*batch, n, heads, dim))
    k = rng.standard_normal((*batch, n_k, kv_heads, dim))
    v = rng.standard_normal((*batch, n_k, kv_heads, value_dim))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def same_bin(grid, i, j):
    """plsh's bin test on integer position arrays i, j (broadcast)."""
    if math.isinf(grid.pitch):
        return np.ones(np.broadcast(i, j).shape, dtype=bool)
    if grid.pitch <= 1:
        return i == j
    return np.floor((i - grid.shift) / grid.pitch) == np.floor((j - grid.shift) / grid.pitch)


DEFAULT_SAMPLING = plsh.PLSH_DEFAULTS["sampling"]
DEFAULT_NEAR_FIELD = plsh.PLSH_DEFAULTS["near_field"]


def near_reach(slope, near_field):
    """The near field's reach: the largest distance d with exp(-m d) >= near_field (-1: none)."""
    if near_field == 0:
        return -1
    if slope == 0:
        return math.inf
    return math.floor(-math.log(near_field) / slope)  # 1 / near_field overflows below 5.6e-309


def alibi_log_factor(slopes, samples=None, seed=None, sampling=DEFAULT_SAMPLING,
                     near_field=DEFAULT_NEAR_FIELD):
    """log F_h(i, j): ALiBi -m_h |i - j| (samples None) or, for Positional LSH, -m_h |i - j|
    within the near field's reach and the log of the mean block mask c/s of the grids
    plsh.kernel_grids(slopes, samples, seed, sampling=sampling) beyond."""
    def exact(h, i, j):
        return -slopes[h] * np.abs(i - j).astype(np.float64)

    if samples is None:
        return exact
    grids = plsh.kernel_grids(slopes, samples, seed, sampling=sampling)

    def counted(h, i, j):
        count = sum(same_bin(grid, i, j).astype(np.float64) for grid in grids[h])
        with np.errstate(divide="ignore"):
            blocks = np.log(count / samples)
        near = np.abs(i - j) <= near_reach(slopes[h], near_field)
        return np.where(near, exact(h, i, j), blocks)

    return counted


def truncated_log_factor(slopes, factor_tolerance):
    """log F_h(i, j) of ALiBi truncated where the factor exp(-m_h |i - j|) falls below
    factor_tolerance: -m_h |i - j| for |i - j| <= floor(ln(1/factor_tolerance) / m_h), -inf
    beyond (every key when m_h or factor_tolerance is 0)."""
    exact = alibi_log_factor(slopes)

    def factor(h, i, j):
        distance = np.abs(i - j)
        if slopes[h] == 0 or factor_tolerance == 0:
            return exact(h, i, j)
        band = math.floor(math.log(1 / factor_tolerance) / slopes[h])
        return np.where(distance <= band, exact(h, i, j), -np.inf)

    return factor


def fixed_log_factor(block_size):
    grid = plsh.Grid(float(block_size), 0.0)

    def factor(h, i, j):
        with np.errstate(divide="ignore"):
            return np.log(same_bin(grid, i, j).astype(np.float64))

    return factor


def reference_attention(q, k, v, log_factor, causal=True, softmax_scale=None, query_position=0,
                        key_position=0):
    """Dense float64 attention with logits softmax_scale q.k + log_factor(h, i, j) (scale None:
    1/sqrt(d)); rank 3 or 4."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim == 4:
        return np.stack([reference_attention(q[b], k[b], v[b], log_factor, causal, softmax_scale,
                                             query_position, key_position)
                         for b in range(q.shape[0])])
    n_q, heads, dim = q.shape
    n_k, kv_heads, value_dim = v.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    i = query_position + np.arange(n_q)[:, None]
    j = key_position + np.arange(n_k)[None, :]
    out = np.zeros((n_q, heads, value_dim))
    for h in range(heads):
        g = h // (heads // kv_heads)
        logits = scale * q[:, h] @ k[:, g].T + log_factor(h, i, j)
        if causal:
            logits = np.where(j > i, -np.inf, logits)
        top = logits.max(axis=1, keepdims=True)
        visible = np.isfinite(top[:, 0])
        weights = np.where(np.isfinite(logits), np.exp(logits - np.where(visible[:, None], top, 0)),
                           0.0)
        sums = weights.sum(axis=1, keepdims=True)
        out[:, h] = np.where(visible[:, None], (weights / np.where(sums > 0, sums, 1)) @ v[:, g],
                             0.0)
    return out


# Unit roundoff of rounding to nearest: float16 keeps 11 significant bits, bfloat16 8.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def to_bfloat16_bits(x):
    """x rounded to bfloat16 (to nearest even), as the uint16 bit patterns the module takes."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bfloat16_bits(bits):
    """The float32 values of bfloat16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def call_forward(name, q, k, v, **kwargs):
    """The forward `name` with its required extra argument."""
    if name == "fixed_block_attention":
        return plsh.fixed_block_attention(q, k, v, 8, **kwargs)
    if name == "truncated_alibi_attention":
        return plsh.truncated_alibi_attention(q, k, v, None, 0.05, **kwargs)
    return getattr(plsh, name)(q, k, v, **kwargs)


FORWARDS = ["exact_alibi_attention", "windowed_alibi_attention", "truncated_alibi_attention",
            "plsh_attention", "fixed_block_attention"]


def to_storage(x, storage):
    """x rounded to `storage` as the module takes it: float16, or bfloat16 bits as uint16."""
    return x.astype(np.float16) if storage == "float16" else to_bfloat16_bits(x)


def from_storage(x, storage):
    return x.astype(np.float32) if storage == "float16" else from_bfloat16_bits(x)


def assert_rounded_values(x, y, storage, name):
    """x is the float32 result y rounded to `storage` (both as float64 arrays): within u |y|
    (u = 2^-11 for float16, 2^-8 for bfloat16) plus the float32 kernel's own error, 3e-5 of the
    largest |y| (a tile copied to float32 may sum in another order), plus half float16's subnormal
    step."""
    bound = UNIT_ROUNDOFF[storage] * np.abs(y) + 3e-5 * np.abs(y).max() + 2.0 ** -25
    excess = np.abs(x - y) / bound
    assert excess.max() <= 1, f"{name}: worst |x - y| / bound {excess.max()}"


def assert_rounded(result, expected, storage, name):
    """`result` (an array in `storage`) is the float32 result `expected` rounded
    (assert_rounded_values)."""
    assert_rounded_values(from_storage(result, storage).astype(np.float64),
                          expected.astype(np.float64), storage, name)



@pytest.fixture
def inputs():
    """Batched float64 inputs with grouped heads: q [2, 40, 4, 8], k [2, 40, 2, 8], v [2, 40, 2, 6]."""
    return random_inputs((2, 40, 4, 8), kv_heads=2, value_dim=6, seed=1)
