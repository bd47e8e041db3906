"""Tests of the NumPy API of plsh: argument errors. Integers checked by name and range, dtypes,
ranks, shapes and out= arrays named in TypeError and ValueError, the C++ messages of option
errors, and an empty batch checked like a batch of one."""

import math

import numpy as np
import pytest

import plsh
from conftest import random_inputs


def empty_batch_cases():
    """(description, call, message) for calls on a batch of 0 elements that break a rule."""
    q, k, v = random_inputs((0, 5, 4, 8), kv_heads=2, value_dim=6, dtype=np.float32)
    odd_q = np.zeros((0, 5, 3, 8), np.float32)
    narrow_k = np.zeros((0, 5, 2, 7), np.float32)
    out = np.zeros((0, 5, 4, 6), np.float32)
    nan = float("nan")
    return [
        ("heads", lambda: plsh.exact_alibi_attention(odd_q, k, v), "the heads of q must be a multiple of those of k and v"),
        ("dims", lambda: plsh.exact_alibi_attention(q, narrow_k, v), "q and k disagree on their last axis"),
        ("slopes", lambda: plsh.windowed_alibi_attention(q, k, v, [0.5, nan, 0.1, 0.2]),
         r"slopes\[1\] must be finite"),
        ("samples", lambda: plsh.plsh_attention(q, k, v, samples=0), "options.samples"),
        ("scale", lambda: plsh.fixed_block_attention(q, k, v, 4, softmax_scale=nan),
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


def test_dtype_errors_name_the_argument(inputs):
    q, k, v = inputs
    with pytest.raises(TypeError, match=r"^q must be a numpy.ndarray \(got list\)"):
        plsh.exact_alibi_attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match=r"^q has dtype int64; plsh takes float32, float64, "
                                        r"float16, or bfloat16 as uint16"):
        plsh.plsh_attention(q.astype(np.int64), k, v)
    with pytest.raises(TypeError, match=r'^q has dtype uint16; .*pass dtype="bfloat16"'):
        plsh.exact_alibi_attention(q.astype(np.uint16), k, v)
    with pytest.raises(TypeError, match=r'^q has dtype float32; with dtype="bfloat16" the arrays '
                                        r"hold bfloat16 bit patterns as uint16"):
        plsh.exact_alibi_attention(q.astype(np.float32), k, v, dtype="bfloat16")
    with pytest.raises(TypeError, match=r"^k has dtype float64 but q has float16"):
        plsh.exact_alibi_attention(q.astype(np.float16), k, v)
    with pytest.raises(TypeError, match=r"^v has dtype float16 but q has bfloat16"):
        plsh.exact_alibi_attention(q.astype(np.uint16), k.astype(np.uint16), v.astype(np.float16),
                                   dtype="bfloat16")
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
    with pytest.raises(ValueError, match=r"^q and k disagree on their last axis \(dim\): q has 8, "
                                         r"k has 5 \(axis 3 \(dim\) of layout \"bthd\""):
        plsh.exact_alibi_attention(q, k[..., :5], v)
    with pytest.raises(ValueError, match=r"^q has 3 heads and k and v have 2 \(axis 2 \(heads\)"):
        plsh.plsh_attention(q[..., :3, :], k, v)
    with pytest.raises(ValueError, match=r"^k and v disagree on their tokens axis: k has 40, v has 5"):
        plsh.fixed_block_attention(q, k, v[:, :5], 4)
    with pytest.raises(ValueError, match=r"^out must have shape \(2, 40, 4, 6\) \(got \(2, 40, 4, 5\)\)"):
        plsh.exact_alibi_attention(q, k, v, out=np.empty((2, 40, 4, 5)))
    with pytest.raises(ValueError, match=r"^dout must have the forward output's shape "
                                         r"\(2, 40, 4, 6\), q's with v's last axis"):
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
    with pytest.raises(ValueError, match=r"^alibi_slopes has 3 entries but q has 4 heads"):
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
        plsh.exact_alibi_attention(q, k, v, softmax_scale=math.inf)
    with pytest.raises(ValueError, match=r"^fixed_block_attention: block_size must be at least 1"):
        plsh.fixed_block_attention(q, k, v, 0)
    with pytest.raises(ValueError, match=r"tolerance must lie in \[0, 1\]"):
        plsh.windowed_alibi_attention(q, k, v, tolerance=2.0)
