"""Tests of the NumPy API of plsh in float16 and bfloat16 (uint16 bit patterns with
dtype="bfloat16"), computed in float32: the float32 kernels on rounded inputs, and the error against
float32 inputs."""

import numpy as np
import pytest

import plsh
from conftest import (FORWARDS, UNIT_ROUNDOFF, assert_rounded, call_forward, from_storage,
                      random_inputs, to_storage)

HALF_TYPES = ["float16", "bfloat16"]

@pytest.mark.parametrize("storage", HALF_TYPES)
@pytest.mark.parametrize("name", FORWARDS)
def test_half_forward_is_the_float32_kernel_on_rounded_inputs(name, storage, inputs):
    stored = [to_storage(x, storage) for x in inputs]
    rounded = [from_storage(x, storage) for x in stored]
    dtype = "bfloat16" if storage == "bfloat16" else None
    for options in (dict(query_position=4), dict(causal=False, key_position=3)):
        result = call_forward(name, *stored, dtype=dtype, **options)
        assert result.dtype == stored[0].dtype and result.shape == (2, 40, 4, 6)
        assert_rounded(result, call_forward(name, *rounded, **options), storage, name)
        out = np.zeros_like(result)
        call_forward(name, *stored, dtype=dtype, out=out, **options)
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
    grads = backward(*stored, query_position=6,
                     dtype="bfloat16" if storage == "bfloat16" else None)
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
                                        dtype="bfloat16" if storage == "bfloat16" else None)
    error = (np.linalg.norm(from_storage(result, storage) - expected) /
             np.linalg.norm(expected))
    assert error <= 4 * UNIT_ROUNDOFF[storage], f"{error / UNIT_ROUNDOFF[storage]} u"
