"""Tests of plsh.torch: autograd functions against dense PyTorch references and gradcheck, the
C++ results bit for bit, strided tensors, errors, and AlibiAttention's seeds."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import plsh  # noqa: E402
import plsh.torch as pt  # noqa: E402
from conftest import UNIT_ROUNDOFF, alibi_log_factor, assert_rounded_values  # noqa: E402


def random_tensors(batch=2, n=24, heads=4, kv_heads=2, dim=8, value_dim=6, n_k=None, seed=0,
                   dtype=torch.float64, requires_grad=True):
    generator = torch.Generator().manual_seed(seed)
    n_k = n if n_k is None else n_k
    shapes = [(batch, n, heads, dim), (batch, n_k, kv_heads, dim),
              (batch, n_k, kv_heads, value_dim)]
    tensors = [torch.randn(*shape, generator=generator, dtype=dtype) for shape in shapes]
    tensors[0] *= 2
    return [t.requires_grad_(requires_grad) for t in tensors]


def dense_alibi(q, k, v, slopes, causal=True, softmax_scale=None, query_position=0, key_position=0,
                log_counts=None):
    """ALiBi as PyTorch users write it (Press et al.): softmax(q k^T scale - m |i - j|) v, causal;
    with `log_counts` [H, n_q, n_k] the bias is log c instead (Positional LSH's mean mask)."""
    heads, kv_heads = q.shape[-2], k.shape[-2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qh = q.transpose(-2, -3)  # [B, H, n, d]
    kh = k.transpose(-2, -3).repeat_interleave(heads // kv_heads, dim=-3)
    vh = v.transpose(-2, -3).repeat_interleave(heads // kv_heads, dim=-3)
    i = query_position + torch.arange(q.shape[-3])[:, None]
    j = key_position + torch.arange(k.shape[-3])[None, :]
    if log_counts is None:
        m = torch.tensor(slopes, dtype=q.dtype)[:, None, None]
        bias = -m * (i - j).abs().to(q.dtype)
    else:
        bias = log_counts.to(q.dtype)
    scores = qh @ kh.transpose(-1, -2) * scale + bias
    if causal:
        scores = scores.masked_fill(j > i, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row without keys: zeros
    return (weights @ vh).transpose(-2, -3)


def log_counts(slopes, samples, seed, n_q, n_k, query_position=0, key_position=0, **estimator):
    """The log factors [H, n_q, n_k] of Positional LSH (conftest.alibi_log_factor)."""
    i = query_position + np.arange(n_q)[:, None]
    j = key_position + np.arange(n_k)[None, :]
    factor = alibi_log_factor(slopes, samples, seed, **estimator)
    return torch.from_numpy(np.stack([factor(h, i, j) for h in range(len(slopes))]))


OPTIONS = dict(causal=True, softmax_scale=None, query_position=7, key_position=2)

# The draws of each Positional LSH method of the tests.
ESTIMATOR = {"plsh": dict(sampling="independent", near_field=0.0),
             "plsh latin": dict(sampling="latin_hypercube", near_field=0.0),
             "plsh near field": dict(sampling="latin_hypercube", near_field=0.1)}


def assert_close(a, b, atol):
    assert a.shape == b.shape
    assert torch.allclose(a, b, rtol=0, atol=atol), (a - b).abs().max().item()


@pytest.mark.parametrize("method", ["exact", "plsh", "plsh latin", "plsh near field"])
def test_forward_and_gradients_against_dense_pytorch(method):
    q, k, v = random_tensors(seed=1)
    slopes = [0.4, 0.2, 0.1, 0.0]
    if method == "exact":
        out = pt.exact_alibi_attention(q, k, v, slopes, **OPTIONS)
        reference = dense_alibi(q, k, v, slopes, **OPTIONS)
    else:
        estimator = ESTIMATOR[method]
        out = pt.plsh_attention(q, k, v, slopes, samples=7, seed=3, **estimator, **OPTIONS)
        counts = log_counts(slopes, 7, 3, q.shape[1], k.shape[1], 7, 2, **estimator)
        reference = dense_alibi(q, k, v, slopes, log_counts=counts, **OPTIONS)
    assert_close(out, reference, 1e-12)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5),
                          dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for grad, reference_grad in zip(grads, expected):
        assert_close(grad, reference_grad, 1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_outputs_and_gradients_equal_the_cpp_kernels_and_accumulate(dtype):
    # 4 MiB and more per tensor: the output and the gradients are tensors on the kernels' own new
    # arrays (mapped in huge pages); the same bits as the kernels writing into arrays from NumPy,
    # and gradients that accumulate in place.
    q, k, v = random_tensors(batch=1, n=4096, heads=8, kv_heads=8, dim=64, value_dim=64, seed=3,
                             dtype=torch.float32, requires_grad=False)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    bits = pt._array  # the arrays plsh.torch hands the kernels (bfloat16: uint16 bit patterns)
    keywords = dict(dtype=pt._kernel_dtype(dtype))
    out = pt.plsh_attention(q, k, v)
    assert out.dtype == dtype and out.is_contiguous()
    expected = np.empty_like(bits(q))
    _, lse = plsh.plsh_attention(bits(q), bits(k), bits(v), out=expected, return_lse=True,
                                 **keywords)
    assert np.array_equal(bits(out), expected)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    grads = [np.empty_like(expected) for _ in range(3)]
    plsh.plsh_attention_backward(bits(q), bits(k), bits(v), expected, bits(dout), lse=lse,
                                 dq=grads[0], dk=grads[1], dv=grads[2], **keywords)
    out.backward(dout)
    for tensor, grad in zip((q, k, v), grads):
        assert tensor.grad.dtype == dtype and np.array_equal(bits(tensor.grad), grad)
    first = [tensor.grad.clone() for tensor in (q, k, v)]
    pt.plsh_attention(q, k, v).backward(dout)
    for tensor, grad in zip((q, k, v), first):
        assert torch.equal(tensor.grad, grad + grad)


@pytest.mark.parametrize("method", ["exact", "plsh", "plsh latin", "plsh near field"])
def test_results_equal_the_cpp_kernels_bit_for_bit(method):
    q, k, v = random_tensors(dtype=torch.float32, seed=2)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(1))
    # The backward of plsh.torch is the C++ backward given the forward's row log-sum-exp.
    if method == "exact":
        out = pt.exact_alibi_attention(q, k, v, **OPTIONS)
        expected, lse = plsh.exact_alibi_attention(*arrays, return_lse=True, **OPTIONS)
        grads = plsh.exact_alibi_attention_backward(*arrays, expected, dout.numpy(), lse=lse,
                                                    **OPTIONS)
    else:
        draws = dict(samples=9, seed=4, **ESTIMATOR[method])
        out = pt.plsh_attention(q, k, v, **draws, **OPTIONS)
        expected, lse = plsh.plsh_attention(*arrays, **draws, return_lse=True, **OPTIONS)
        grads = plsh.plsh_attention_backward(*arrays, expected, dout.numpy(), **draws, lse=lse,
                                             **OPTIONS)
    assert out.dtype == torch.float32
    assert np.array_equal(out.detach().numpy(), expected)
    out.backward(dout)
    for tensor, grad in zip((q, k, v), grads):
        assert np.array_equal(tensor.grad.numpy(), grad)


@pytest.mark.parametrize("method", ["exact", "plsh", "plsh latin", "plsh near field"])
def test_gradcheck_with_grouped_heads_and_offsets(method):
    q, k, v = random_tensors(batch=2, n=6, heads=4, kv_heads=2, dim=3, value_dim=2, n_k=8, seed=3)
    options = dict(causal=True, softmax_scale=0.7, query_position=5, key_position=1)
    if method == "exact":
        def function(q, k, v):
            return pt.exact_alibi_attention(q, k, v, [0.5, 0.3, 0.2, 0.1], **options)
    else:
        def function(q, k, v):
            return pt.plsh_attention(q, k, v, [0.5, 0.3, 0.2, 0.1], samples=4, seed=2,
                                     **ESTIMATOR[method], **options)
    assert torch.autograd.gradcheck(function, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_bidirectional_rank_three():
    q, k, v = (t[0].detach().requires_grad_() for t in
               random_tensors(batch=1, n=5, heads=2, kv_heads=1, dim=3, value_dim=3, seed=4))
    assert torch.autograd.gradcheck(
        lambda q, k, v: pt.plsh_attention(q, k, v, samples=3, seed=1, causal=False), (q, k, v),
        eps=1e-6, atol=1e-7, rtol=1e-5)


def test_non_contiguous_tensors_give_the_same_results():
    q, k, v = random_tensors(dtype=torch.float32, seed=6, requires_grad=False)
    out = pt.plsh_attention(q, k, v)
    # [B, H, T, D] storage seen as [B, T, H, D]: a transposed, non-contiguous tensor.
    views = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    assert not views[0].is_contiguous()
    strided = pt.plsh_attention(*views)
    assert torch.equal(out, strided)
    # Gradients through the strided inputs equal those of contiguous ones.
    contiguous = [t.clone().requires_grad_() for t in (q, k, v)]
    pt.plsh_attention(*contiguous).sum().backward()
    strided.sum().backward()  # dout is an expanded tensor (stride 0): copied by the binding
    for a, b in zip(views, contiguous):
        assert torch.equal(a.grad, b.grad)
    # A sliced tensor (every other head of a wider one).
    wide = torch.randn(2, 24, 8, 8, generator=torch.Generator().manual_seed(2))
    sliced = wide[:, :, ::2]
    assert torch.equal(pt.exact_alibi_attention(sliced, k, v),
                       pt.exact_alibi_attention(sliced.contiguous(), k, v))


def test_float32_and_rank_three():
    q, k, v = (t[0] for t in random_tensors(dtype=torch.float32, seed=7, requires_grad=False))
    out = pt.exact_alibi_attention(q, k, v)
    assert out.shape == (24, 4, 6) and out.dtype == torch.float32
    assert torch.equal(out, pt.exact_alibi_attention(q[None], k[None], v[None])[0])


def test_no_bias_is_exact_alibi_with_zero_slopes():
    q, k, v = random_tensors(seed=8, requires_grad=False)
    out = pt.exact_alibi_attention(q, k, v, [0.0] * 4)
    plain = dense_alibi(q, k, v, [0.0] * 4)
    assert_close(out, plain, 1e-12)


def fixed_log_counts(block_size, n_q, n_k, query_position=0, key_position=0):
    i = query_position + torch.arange(n_q)[:, None]
    j = key_position + torch.arange(n_k)[None, :]
    same = (i // block_size == j // block_size).to(torch.float64)
    return torch.log(same)[None]  # log 1 = 0 inside a block, -inf outside


def test_fixed_block_attention_against_dense_pytorch_and_cpp():
    q, k, v = random_tensors(seed=9)
    out = pt.fixed_block_attention(q, k, v, 8, **OPTIONS)
    counts = fixed_log_counts(8, q.shape[1], k.shape[1], 7, 2)
    reference = dense_alibi(q, k, v, None, log_counts=counts, **OPTIONS)
    assert_close(out, reference, 1e-12)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for grad, reference_grad in zip(grads, expected):
        assert_close(grad, reference_grad, 1e-11)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    cpp_out, lse = plsh.fixed_block_attention(*arrays, 8, return_lse=True, **OPTIONS)
    assert np.array_equal(out.detach().numpy(), cpp_out)
    # The backward of plsh.torch is the C++ backward given the forward's row log-sum-exp.
    cpp_grads = plsh.fixed_block_attention_backward(*arrays, cpp_out, weights.numpy(), 8,
                                                    lse=lse, **OPTIONS)
    for grad, cpp_grad in zip(grads, cpp_grads):
        assert np.array_equal(grad.numpy(), cpp_grad)


def test_fixed_block_gradcheck_with_grouped_heads_and_offsets():
    q, k, v = random_tensors(batch=2, n=6, heads=4, kv_heads=2, dim=3, value_dim=2, n_k=8, seed=4)

    def function(q, k, v):
        return pt.fixed_block_attention(q, k, v, 3, causal=True, softmax_scale=0.7, query_position=5,
                                        key_position=1)

    assert torch.autograd.gradcheck(function, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_errors():
    q, k, v = random_tensors(dtype=torch.float32, requires_grad=False)
    with pytest.raises(TypeError, match=r"^q has dtype torch.int64; plsh takes torch.float32, "
                                        r"torch.float64, torch.float16 or torch.bfloat16"):
        pt.exact_alibi_attention(q.long(), k, v)
    with pytest.raises(TypeError, match=r"^k has dtype torch.float16 but q has torch.bfloat16"):
        pt.exact_alibi_attention(q.bfloat16(), k.half(), v.bfloat16())
    with pytest.raises(TypeError, match=r"^k has dtype torch.float64 but q has torch.float32"):
        pt.exact_alibi_attention(q, k.double(), v)
    with pytest.raises(TypeError, match=r"^v must be a torch.Tensor \(got ndarray\)"):
        pt.plsh_attention(q, k, v.numpy())
    # A tensor that is not on the CPU ("meta" stands in for CUDA, which this machine lacks).
    with pytest.raises(TypeError, match=r"^q is on device meta; plsh runs on CPU tensors only"):
        pt.plsh_attention(torch.empty(q.shape, device="meta"), k, v)
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match=r"plsh runs on CPU tensors only"):
            pt.plsh_attention(q.cuda(), k, v)
    with pytest.raises(ValueError, match=r"^q must have 3 dimensions"):
        pt.exact_alibi_attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"^q and k disagree on their last axis \(dim\): q has 8, "
                                         r"k has 5 \(axis 3 \(dim\) of layout \"bthd\""):
        pt.plsh_attention(q, k[..., :5], v)
    with pytest.raises(ValueError, match=r"^alibi_slopes has 2 entries but q has 4 heads \(axis 2 "
                                         r"\(heads\) of layout \"bthd\" \[batch, tokens, heads, "
                                         r"dim\]\); give one slope per query head"):
        pt.exact_alibi_attention(q, k, v, [0.1, 0.2])
    with pytest.raises(ValueError, match=r'^sampling must be "independent" or "latin_hypercube" '
                                         r'\(got "stratified"\)$'):
        pt.plsh_attention(q, k, v, sampling="stratified")


@pytest.mark.parametrize("method", ["exact", "plsh", "fixed"])
def test_batches_of_zero_tokens_give_empty_outputs_and_gradients(method):
    q, k, v = (torch.randn(2, 0, 4, 8, requires_grad=True) for _ in range(3))
    if method == "fixed":
        out = pt.fixed_block_attention(q, k, v, 4)
    else:
        out = getattr(pt, "exact_alibi_attention" if method == "exact" else "plsh_attention")(q, k, v)
    assert out.shape == (2, 0, 4, 8)
    out.sum().backward()
    assert [t.grad.shape for t in (q, k, v)] == [(2, 0, 4, 8)] * 3


def test_integer_arguments_are_not_truncated():
    q, k, v = random_tensors(requires_grad=False)
    with pytest.raises(TypeError, match=r"^seed must be an integer \(got float\)$"):
        pt.plsh_attention(q, k, v, seed=1.7)
    with pytest.raises(TypeError, match=r"^samples must be an integer \(got float\)$"):
        pt.plsh_attention(q, k, v, samples=20.0)
    with pytest.raises(TypeError, match=r"^block_size must be an integer \(got str\)$"):
        pt.fixed_block_attention(q, k, v, "8")
    with pytest.raises(ValueError, match=r"^seed must be an integer in \[0, 18446744073709551615\]"):
        pt.plsh_attention(q, k, v, seed=-1)


def test_alibi_attention_module_checks_its_arguments_when_built():
    with pytest.raises(ValueError, match=r"^seed must lie in \[0, 2\*\*64 - 1\] \(got -1\)$"):
        pt.AlibiAttention(4, seed=-1)
    with pytest.raises(ValueError, match=r"^seed must lie in"):
        pt.AlibiAttention(4, seed=2 ** 64)
    with pytest.raises(TypeError, match=r"^seed must be an integer \(got float\)$"):
        pt.AlibiAttention(4, seed=1.7)
    with pytest.raises(ValueError, match=r"^samples must be at least 1 \(got 0\)$"):
        pt.AlibiAttention(4, samples=0)
    with pytest.raises(ValueError, match=r"^block_size must be at least 1 \(got 0\)$"):
        pt.AlibiAttention(4, method="fixed", block_size=0)


def test_alibi_attention_module_seed_wraps_and_counts_only_forwards_that_return():
    q, k, v = random_tensors(seed=14, requires_grad=False)
    module = pt.AlibiAttention(4, method="plsh", samples=3, seed=2 ** 64 - 1)
    module.train()
    assert torch.equal(module(q, k, v), pt.plsh_attention(q, k, v, samples=3, seed=2 ** 64 - 1))
    assert module.current_seed() == 0
    assert torch.equal(module(q, k, v), pt.plsh_attention(q, k, v, samples=3, seed=0))
    assert int(module.training_forwards) == 2
    with pytest.raises(ValueError, match=r"q and k disagree on their last axis \(dim\)"):
        module(q, k[..., :5], v)
    assert int(module.training_forwards) == 2


def test_slopes_as_a_tensor():
    q, k, v = random_tensors(seed=10, requires_grad=False)
    slopes = [0.3, 0.2, 0.1, 0.05]
    assert torch.equal(pt.exact_alibi_attention(q, k, v, torch.tensor(slopes, dtype=torch.float64)),
                       pt.exact_alibi_attention(q, k, v, slopes))


def test_alibi_attention_module_seeds():
    q, k, v = random_tensors(seed=11, requires_grad=False)
    module = pt.AlibiAttention(4, method="plsh", samples=5, seed=100)
    assert "method='plsh'" in repr(module)
    module.train()
    for step in range(3):
        out = module(q, k, v)
        assert torch.equal(out, pt.plsh_attention(q, k, v, samples=5, seed=100 + step))
    assert int(module.training_forwards) == 3
    state = module.state_dict()
    assert int(state["training_forwards"]) == 3
    module.eval()
    for _ in range(2):
        assert torch.equal(module(q, k, v), pt.plsh_attention(q, k, v, samples=5, seed=100))
    assert int(module.training_forwards) == 3
    resumed = pt.AlibiAttention(4, method="plsh", samples=5, seed=100)
    resumed.load_state_dict(state)
    assert resumed.current_seed() == 103
    assert torch.equal(resumed(q, k, v), pt.plsh_attention(q, k, v, samples=5, seed=103))


def test_alibi_attention_module_sampling():
    q, k, v = random_tensors(seed=13, requires_grad=False)
    module = pt.AlibiAttention(4, method="plsh", samples=5, seed=100, sampling="latin_hypercube")
    assert "sampling='latin_hypercube'" in repr(module)
    assert "sampling='latin_hypercube'" in repr(pt.AlibiAttention(4))
    assert "near_field=0.05" in repr(pt.AlibiAttention(4))
    module.train()
    for step in range(2):
        out = module(q, k, v)
        assert torch.equal(out, pt.plsh_attention(q, k, v, samples=5, seed=100 + step,
                                                  sampling="latin_hypercube"))
        assert not torch.equal(out, pt.plsh_attention(q, k, v, samples=5, seed=100 + step,
                                                      sampling="independent"))
    module.eval()
    assert torch.equal(module(q, k, v),
                       pt.plsh_attention(q, k, v, samples=5, seed=100, sampling="latin_hypercube"))
    with pytest.raises(ValueError, match=r"^sampling must be one of \('independent', "
                                         r"'latin_hypercube'\) \(got 'lhs'\)$"):
        pt.AlibiAttention(4, sampling="lhs")


def test_alibi_attention_module_methods():
    q, k, v = random_tensors(seed=12, requires_grad=False)
    slopes = plsh.alibi_slopes(4)
    assert torch.equal(pt.AlibiAttention(4, "exact")(q, k, v),
                       pt.exact_alibi_attention(q, k, v, slopes))
    assert torch.equal(pt.AlibiAttention(4, "none")(q, k, v),
                       pt.exact_alibi_attention(q, k, v, [0.0] * 4))
    with torch.no_grad():
        assert torch.equal(pt.AlibiAttention(4, "fixed", block_size=8)(q, k, v),
                           pt.fixed_block_attention(q, k, v, 8))
    custom = pt.AlibiAttention(4, "exact", alibi_slopes=[0.5, 0.5, 0.1, 0.1], causal=False)
    assert torch.equal(custom(q, k, v),
                       pt.exact_alibi_attention(q, k, v, [0.5, 0.5, 0.1, 0.1], causal=False))
    # Gradients flow through the module.
    q.requires_grad_()
    pt.AlibiAttention(4, "plsh", samples=3)(q, k, v).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match=r"method must be one of"):
        pt.AlibiAttention(4, method="dense")
    with pytest.raises(ValueError, match=r"heads must be at least 1"):
        pt.AlibiAttention(0)
    with pytest.raises(ValueError, match=r"alibi_slopes has 2 entries, one per head expected: "
                                         r"heads is 4"):
        pt.AlibiAttention(4, alibi_slopes=[0.1, 0.2])
    with pytest.raises(ValueError, match=r'q has 4 heads \(axis 2 of layout "bthd" \[batch, tokens, '
                                         r'heads, dim\]\) but the module has 2; tensors in '
                                         r'PyTorch SDPA\'s order'):
        pt.AlibiAttention(2)(q, k, v)


# float16 and bfloat16 tensors: computed in float32, outputs and gradients in the input dtype.

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
HALF_METHODS = {
    "exact": (lambda q, k, v: pt.exact_alibi_attention(q, k, v, **OPTIONS),
              lambda *a: plsh.exact_alibi_attention_backward(*a, **OPTIONS)),
    "plsh": (lambda q, k, v: pt.plsh_attention(q, k, v, samples=5, seed=2, **OPTIONS),
             lambda *a: plsh.plsh_attention_backward(*a, samples=5, seed=2, **OPTIONS)),
    "fixed": (lambda q, k, v: pt.fixed_block_attention(q, k, v, 8, **OPTIONS),
              lambda *a: plsh.fixed_block_attention_backward(*a, 8, **OPTIONS)),
}


def assert_rounded(result, expected, storage, name):
    """`result` (a float16 or bfloat16 tensor) is the float32 `expected` rounded to `storage`
    (conftest.assert_rounded_values)."""
    assert_rounded_values(result.detach().double().numpy(), np.asarray(expected, dtype=np.float64),
                          storage, name)


def half_inputs(dtype, seed=11):
    """q, k, v rounded to `dtype` (leaf tensors with gradients) and their float32 values."""
    tensors = random_tensors(dtype=torch.float32, seed=seed, requires_grad=False)
    half = [t.to(dtype).requires_grad_() for t in tensors]
    return half, [t.detach().float() for t in half], tensors


@pytest.mark.parametrize("storage", HALF_DTYPES)
@pytest.mark.parametrize("method", HALF_METHODS)
def test_half_tensors_are_the_float32_kernels_on_rounded_inputs(method, storage):
    dtype = HALF_DTYPES[storage]
    forward, backward = HALF_METHODS[method]
    half, rounded, _ = half_inputs(dtype)
    out = forward(*half)
    assert out.dtype == dtype
    assert_rounded(out, forward(*rounded), storage, "out")
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    (out * weights).sum().backward()  # dout = weights, exactly, in dtype
    # The backward kernel in float32 on what the half backward reads: the rounded q, k, v, the
    # saved (rounded) out and dout.
    expected = backward(*(t.numpy() for t in rounded), out.detach().float().numpy(),
                        weights.float().numpy())
    for name, tensor, reference in zip(("dq", "dk", "dv"), half, expected):
        assert tensor.grad.dtype == dtype
        assert_rounded(tensor.grad, reference, storage, name)


@pytest.mark.parametrize("storage", HALF_DTYPES)
@pytest.mark.parametrize("method", HALF_METHODS)
def test_half_tensors_against_float32_inputs(method, storage):
    """Relative error of the half path (inputs rounded from float32) against float32. Each
    rounding errs by u/sqrt(3) rms; the logits (q with variance 4, k 1, scale 1/sqrt(d)) move by
    sqrt(2 * 4) u/sqrt(3) = 1.6u, v and out add u/sqrt(3) each: about 1.8u for out, bound 4u; the
    gradients carry the logit term twice (P and dP - D) and the rounding of out and dout: 6u."""
    dtype = HALF_DTYPES[storage]
    forward, _ = HALF_METHODS[method]
    half, _, floats = half_inputs(dtype)
    floats = [t.clone().requires_grad_() for t in floats]
    out_half = forward(*half)
    out_float = forward(*floats)
    weights = torch.randn(out_float.shape, generator=torch.Generator().manual_seed(6))
    (out_half * weights.to(dtype)).sum().backward()
    (out_float * weights).sum().backward()

    def relative(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    u = UNIT_ROUNDOFF[storage]
    assert relative(out_half, out_float) <= 4 * u
    for name, a, b in zip(("dq", "dk", "dv"), half, floats):
        assert relative(a.grad, b.grad) <= 6 * u, name


# Each torch function with its C++ forward and backward and the arguments they share.
LSE_METHODS = {
    "exact": (lambda *t, **o: pt.exact_alibi_attention(*t, [0.4, 0.2, 0.1, 0.05], **o),
              plsh.exact_alibi_attention, plsh.exact_alibi_attention_backward,
              ([0.4, 0.2, 0.1, 0.05],), {}),
    "windowed": (lambda *t, **o: pt.windowed_alibi_attention(*t, [0.4, 0.2, 0.1, 0.05],
                                                             tolerance=1e-3, **o),
                 plsh.windowed_alibi_attention, plsh.windowed_alibi_attention_backward,
                 ([0.4, 0.2, 0.1, 0.05], 1e-3), {}),
    "truncated": (lambda *t, **o: pt.truncated_alibi_attention(*t, [0.4, 0.2, 0.1, 0.05], 0.05,
                                                               **o),
                  plsh.truncated_alibi_attention, plsh.truncated_alibi_attention_backward,
                  ([0.4, 0.2, 0.1, 0.05], 0.05), {}),
    "plsh": (lambda *t, **o: pt.plsh_attention(*t, samples=9, seed=4, **o),
             plsh.plsh_attention, plsh.plsh_attention_backward, (), dict(samples=9, seed=4)),
    "fixed": (lambda *t, **o: pt.fixed_block_attention(*t, 5, **o),
              plsh.fixed_block_attention, plsh.fixed_block_attention_backward, (5,), {}),
}


@pytest.mark.parametrize("method", LSE_METHODS)
@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_gradients_equal_the_backward_that_computes_the_lse(method, layout):
    # float64: the backward given the forward's lse differs from the one that computes it by
    # rounding only.
    function, forward, backward, arguments, keywords = LSE_METHODS[method]
    q, k, v = random_tensors(n=70, seed=5)
    if layout == "bhtd":
        q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    options = dict(OPTIONS, layout=layout)
    out = function(q, k, v, **options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=out.dtype)
    out.backward(dout)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    expected = backward(*arrays, out.detach().numpy(), dout.numpy(), *arguments, **keywords,
                        **options)
    for tensor, grad in zip((q, k, v), expected):
        assert np.abs(tensor.grad.numpy() - grad).max() <= 1e-12 * max(1.0, np.abs(grad).max())


@pytest.mark.parametrize("method", LSE_METHODS)
def test_the_backward_gets_the_forward_lse_and_kept_keys(method, monkeypatch):
    function, forward, backward, arguments, keywords = LSE_METHODS[method]
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return backward(*args, **kwargs)

    kernels = {"exact": "_EXACT_KERNELS", "windowed": "_WINDOWED_KERNELS",
               "truncated": "_TRUNCATED_KERNELS", "plsh": "_PLSH_KERNELS",
               "fixed": "_FIXED_BLOCK_KERNELS"}[method]
    monkeypatch.setattr(pt, kernels, (forward, spy))
    q, k, v = random_tensors(dtype=torch.float32, seed=7)
    out = function(q, k, v, **OPTIONS)
    out.sum().backward()
    arrays = [t.detach().numpy() for t in (q, k, v)]
    _, lse, *kept = forward(*arrays, *arguments, **keywords, return_lse=True, **OPTIONS)
    assert len(calls) == 1 and np.array_equal(calls[0]["lse"], lse)
    if method == "windowed":
        assert isinstance(calls[0]["kept"], plsh.KeptKeys) and not calls[0]["kept"].empty
    else:
        assert "kept" not in calls[0]
