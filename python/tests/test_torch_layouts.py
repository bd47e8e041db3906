"""Tests of plsh.torch's layouts, names, decoding cache and model layer: "bhtd" results equal to
"bthd" ones on transposed tensors bit for bit, gradcheck of every autograd function in both
layouts, errors that name the axes, plsh.torch.KvCache against plsh_attention over the whole
sequence, and MultiheadAlibiAttention against nn.Linear projections around dense ALiBi."""

import math
import os
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import plsh  # noqa: E402
import plsh.torch as pt  # noqa: E402


def tensors(batch=2, n=12, heads=4, kv_heads=2, dim=6, value_dim=5, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, n, heads, dim), (batch, n, kv_heads, dim), (batch, n, kv_heads, value_dim)]
    return [torch.randn(*s, generator=generator, dtype=dtype) for s in shapes]


FUNCTIONS = {
    "exact": lambda q, k, v, **o: pt.exact_alibi_attention(q, k, v, **o),
    "windowed": lambda q, k, v, **o: pt.windowed_alibi_attention(q, k, v, tolerance=1e-3, **o),
    # Factor tolerance 0.9: bands of 0, 1, 6 and 26 positions for the standard slopes of 4 heads.
    "truncated": lambda q, k, v, **o: pt.truncated_alibi_attention(q, k, v, None, 0.9, **o),
    "plsh": lambda q, k, v, **o: pt.plsh_attention(q, k, v, samples=4, seed=3, **o),
    "plsh latin": lambda q, k, v, **o: pt.plsh_attention(q, k, v, samples=4, seed=3,
                                                         sampling="latin_hypercube", **o),
    "fixed": lambda q, k, v, **o: pt.fixed_block_attention(q, k, v, 4, **o),
}


def test_version_is_the_cmake_project_version():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "CMakeLists.txt")) as f:
        text = f.read()
    import re
    assert plsh.__version__ == re.search(r"project\(plsh\s+VERSION\s+([0-9.]+)", text).group(1)


def test_the_installed_package_is_tested_when_asked():
    """PLSH_EXPECT_INSTALLED=1 (scripts/python.sh test): plsh comes from the interpreter's
    site-packages, not from the source tree or a build folder."""
    if os.environ.get("PLSH_EXPECT_INSTALLED") != "1":
        pytest.skip("PLSH_EXPECT_INSTALLED is not set")
    location = os.path.realpath(plsh.__file__)
    assert location.startswith(os.path.realpath(sys.prefix)), location
    assert "site-packages" in location, location


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bhtd_equals_bthd_on_transposed_tensors_bit_for_bit(name, dtype):
    q, k, v = tensors(dtype=dtype, seed=1)
    g = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(2)
                    ).to(dtype)
    results = {}
    for layout in ("bthd", "bhtd"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        inputs = leaves if layout == "bthd" else [t.transpose(1, 2) for t in leaves]
        out = FUNCTIONS[name](*inputs, layout=layout, query_position=3)
        gradient = g if layout == "bthd" else g.transpose(1, 2)
        out.backward(gradient)
        if layout == "bhtd":
            assert out.shape == (2, 4, 12, 5)
            out = out.transpose(1, 2)
        results[layout] = [out.detach()] + [t.grad for t in leaves]
    for a, b in zip(results["bthd"], results["bhtd"]):
        assert a.dtype == dtype and torch.equal(a, b)


def test_bhtd_gradients_come_back_in_the_inputs_layout():
    q, k, v = (t.transpose(1, 2).contiguous().requires_grad_() for t in tensors())  # [B, H, T, D]
    pt.exact_alibi_attention(q, k, v, layout="bhtd").sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.is_contiguous()


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_gradcheck_in_both_layouts(name, layout):
    q, k, v = tensors(batch=1, n=9, heads=2, kv_heads=1, dim=3, value_dim=2, seed=4)
    if layout == "bhtd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda *x: FUNCTIONS[name](*x, layout=layout, softmax_scale=0.8, key_position=1),
        inputs)


def test_numpy_kernels_take_the_bhtd_layout_without_copies():
    q, k, v = (t.numpy() for t in tensors(seed=5))
    expected = plsh.plsh_attention(q, k, v, samples=5, seed=1)
    swapped = [np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v)]
    out = np.zeros((2, 4, 12, 5))
    result = plsh.plsh_attention(*swapped, samples=5, seed=1, layout="bhtd", out=out)
    assert result is out
    np.testing.assert_array_equal(out.swapaxes(1, 2), expected)
    dout = np.ones_like(expected)
    grads = plsh.plsh_attention_backward(q, k, v, expected, dout, samples=5, seed=1)
    swapped_grads = plsh.plsh_attention_backward(*swapped, out, dout.swapaxes(1, 2), samples=5,
                                                 seed=1, layout="bhtd")
    for a, b in zip(grads, swapped_grads):
        np.testing.assert_array_equal(a, b.swapaxes(1, 2))


def test_shape_and_layout_errors_name_the_axes():
    q, k, v = tensors()
    sdpa = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # [B, H, T, D] read as bthd
    # Slopes for the 4 heads of SDPA tensors read as bthd (12 "heads").
    with pytest.raises(ValueError, match=r'^alibi_slopes has 4 entries but q has 12 heads \(axis 2 '
                                         r'\(heads\) of layout "bthd" \[batch, tokens, heads, dim\]'
                                         r'\); give one slope per query head; tensors in PyTorch '
                                         r'SDPA\'s order \[batch, heads, tokens, dim\] need '
                                         r'layout="bhtd"'):
        pt.exact_alibi_attention(*sdpa, plsh.alibi_slopes(4))
    with pytest.raises(ValueError, match=r'^alibi_slopes has 2 entries but q has 4 heads \(axis 1 '
                                         r'\(heads\) of layout "bhtd" \[batch, heads, tokens, '
                                         r'dim\]\)'):
        pt.plsh_attention(*sdpa, [0.1, 0.2], layout="bhtd")
    with pytest.raises(ValueError, match=r'^k and v disagree on their heads axis: k has 2, v has 1 '
                                         r'\(axis 2 \(heads\) of layout "bthd"'):
        pt.exact_alibi_attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match=r'^k and v disagree on their heads axis: k has 2, v has 1 '
                                         r'\(axis 1 \(heads\) of layout "bhtd"'):
        pt.exact_alibi_attention(*sdpa[:2], sdpa[2][:, :1], layout="bhtd")
    with pytest.raises(ValueError, match=r'^k and v disagree on their tokens axis: k has 12, v has '
                                         r'11 \(axis 2 \(tokens\) of layout "bhtd"'):
        pt.exact_alibi_attention(*sdpa[:2], sdpa[2][:, :, :11], layout="bhtd")
    with pytest.raises(ValueError, match=r'^q has 4 heads and k and v have 3 \(axis 2 \(heads\)'):
        pt.exact_alibi_attention(q, torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2))
    with pytest.raises(ValueError, match=r'^layout must be "bthd"'):
        pt.exact_alibi_attention(q, k, v, layout="bshd")
    with pytest.raises(ValueError, match=r'^layout must be "bthd"'):
        plsh.exact_alibi_attention(q.numpy(), k.numpy(), v.numpy(), layout="thd")
    with pytest.raises(ValueError, match=r'^out must have shape \(2, 4, 12, 5\)'):
        plsh.exact_alibi_attention(*(t.numpy() for t in sdpa), layout="bhtd",
                                   out=np.zeros((2, 12, 4, 5)))
    with pytest.raises(ValueError, match=r'^dout must have the forward output\'s shape '
                                         r'\(2, 4, 12, 5\)'):
        plsh.exact_alibi_attention_backward(*(t.numpy() for t in sdpa), np.zeros((2, 4, 12, 5)),
                                            np.zeros((2, 12, 4, 5)), layout="bhtd")
    # A module that knows its head count.
    with pytest.raises(ValueError, match=r'^q has 12 heads \(axis 2 of layout "bthd" \[batch, '
                                         r'tokens, heads, dim\]\) but the module has 4; tensors '
                                         r'in PyTorch SDPA\'s order'):
        pt.AlibiAttention(4)(*sdpa)
    assert torch.equal(pt.AlibiAttention(4, "exact", layout="bhtd")(*sdpa),
                       pt.exact_alibi_attention(*sdpa, layout="bhtd"))
    with pytest.raises(ValueError, match=r"^query has 7 features on its last axis \(embed\), the "
                                         r"module embed_dim 8"):
        pt.MultiheadAlibiAttention(8, 2)(torch.zeros(1, 3, 7))
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        pt.MultiheadAlibiAttention(8, 4, 3)


def test_names_of_the_ecosystem_and_deprecated_aliases():
    q, k, v = tensors(seed=6)
    slopes = [0.5, 0.25, 0.1, 0.0]
    expected = pt.exact_alibi_attention(q, k, v, alibi_slopes=slopes, softmax_scale=0.3)
    with pytest.warns(DeprecationWarning, match="slopes= is deprecated"):
        old = pt.exact_alibi_attention(q, k, v, slopes=slopes, softmax_scale=0.3)
    with pytest.warns(DeprecationWarning, match="scale= is deprecated"):
        assert torch.equal(pt.exact_alibi_attention(q, k, v, alibi_slopes=slopes, scale=0.3),
                           expected)
    assert torch.equal(old, expected)
    # None, and the old 0, mean 1/sqrt(D).
    assert torch.equal(pt.plsh_attention(q, k, v, softmax_scale=None),
                       pt.plsh_attention(q, k, v, softmax_scale=1 / math.sqrt(6)))
    with pytest.raises(TypeError, match="not both"):
        pt.exact_alibi_attention(q, k, v, slopes, slopes=slopes)
    # One bfloat16 convention: dtype="bfloat16" for the kernels as for KvCache.
    bits = [t.float().bfloat16().view(torch.int16).numpy().view(np.uint16) for t in (q, k, v)]
    result = plsh.exact_alibi_attention(*bits, dtype="bfloat16")
    with pytest.warns(DeprecationWarning, match='pass dtype="bfloat16"'):
        np.testing.assert_array_equal(plsh.exact_alibi_attention(*bits, bfloat16=True), result)
    np.testing.assert_array_equal(
        result,
        pt.exact_alibi_attention(*(t.float().bfloat16() for t in (q, k, v)))
        .view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(TypeError, match=r'^dtype must be numpy.float32'):
        plsh.exact_alibi_attention(*bits, dtype="int8")
    for function in (pt.plsh_attention, pt.MultiheadAlibiAttention, pt.KvCache, plsh.KvCache,
                     plsh.plsh_attention):
        assert function.__doc__ and len(function.__doc__) > 100
    assert "layout" in plsh.plsh_attention.__doc__ and "alibi_slopes" in plsh.KvCache.__doc__


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_kv_cache_equals_plsh_attention_over_the_whole_sequence(layout, dtype):
    q, k, v = (t[0].to(dtype) for t in tensors(n=20, seed=7))  # [T, H, D]
    options = dict(samples=6, seed=2, sampling="latin_hypercube")
    full = pt.plsh_attention(q, k, v, **options)
    cache = pt.KvCache(4, 2, 6, 5, **options, dtype=dtype, layout=layout)
    as_layout = (lambda t: t.transpose(0, 1)) if layout == "bhtd" else (lambda t: t)
    rows = []
    for t in range(20):
        step = [as_layout(x[t:t + 1]) for x in (q, k, v)]
        out = cache.decode(*step) if t % 2 else (cache.append(*step[1:]) or cache.attend(step[0]))
        assert out.dtype == dtype and out.shape == as_layout(full[:1]).shape
        rows.append(as_layout(out))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(torch.cat(rows).float(), full.float(), rtol=tolerance,
                               atol=tolerance)
    assert cache.position == 20 and cache.resident <= 20 and cache.bytes > 0
    assert cache.oldest_position == 20 - cache.resident
    keys, values = cache.keys(), cache.values()
    assert torch.equal(as_layout(keys), k[20 - cache.resident:])
    assert torch.equal(as_layout(values), v[20 - cache.resident:])
    assert (cache.heads, cache.kv_heads, cache.dim, cache.value_dim) == (4, 2, 6, 5)
    assert cache.alibi_slopes == plsh.alibi_slopes(4)
    assert cache.options["samples"] == 6 and cache.options["sampling"] == "latin_hypercube"
    # A batch axis of 1 is accepted and kept.
    batched = cache.decode(*(x[None] for x in step))
    assert batched.shape == (1,) + out.shape
    with pytest.raises(TypeError, match=r"^k has dtype torch.float64, the cache"):
        cache.append(k[:1].double() if dtype != torch.float64 else k[:1].float(), v[:1])
    with pytest.raises(ValueError, match=r"^q has batch 2 \(axis 0 of layout"):
        cache.attend(torch.zeros((2,) + step[0].shape, dtype=dtype))


def dense_alibi_bthd(q, k, v, slopes):
    """Causal ALiBi with nn-style dense softmax, q [B, T, H, D], k, v [B, T, H_kv, D]."""
    heads, kv_heads, n = q.shape[2], k.shape[2], q.shape[1]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    vh = v.transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    bias = -torch.tensor(slopes, dtype=q.dtype)[:, None, None] * (i - j).abs().to(q.dtype)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
    scores = scores.masked_fill(j > i, -math.inf)
    return (scores.softmax(-1) @ vh).transpose(1, 2)


class Reference(torch.nn.Module):
    """nn.Linear projections around a dense ALiBi softmax."""

    def __init__(self, embed, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, embed // heads
        self.q = torch.nn.Linear(embed, embed, dtype=torch.float64)
        self.k = torch.nn.Linear(embed, kv_heads * self.dim, dtype=torch.float64)
        self.v = torch.nn.Linear(embed, kv_heads * self.dim, dtype=torch.float64)
        self.out = torch.nn.Linear(embed, embed, dtype=torch.float64)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.dim)
        k = self.k(x).view(b, n, self.kv_heads, self.dim)
        v = self.v(x).view(b, n, self.kv_heads, self.dim)
        return self.out(dense_alibi_bthd(q, k, v, plsh.alibi_slopes(self.heads)).flatten(-2))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_multihead_alibi_attention_equals_a_pytorch_reference(kv_heads):
    torch.manual_seed(0)
    layer = pt.MultiheadAlibiAttention(16, 4, kv_heads, method="exact", dtype=torch.float64)
    reference = Reference(16, 4, kv_heads)
    with torch.no_grad():
        w_q, w_k, w_v = layer.in_proj_weight.split([16, 4 * kv_heads, 4 * kv_heads])
        b_q, b_k, b_v = layer.in_proj_bias.split([16, 4 * kv_heads, 4 * kv_heads])
        for linear, w, b in ((reference.q, w_q, b_q), (reference.k, w_k, b_k),
                             (reference.v, w_v, b_v), (reference.out, layer.out_proj.weight,
                                                       layer.out_proj.bias)):
            linear.weight.copy_(w)
            linear.bias.copy_(b)
    x = torch.randn(2, 23, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, layer.in_proj_weight], g)
    expected_grads = torch.autograd.grad(expected, [x, reference.q.weight], g)
    torch.testing.assert_close(grads[0], expected_grads[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grads[1][:16], expected_grads[1], rtol=1e-9, atol=1e-9)
    # Cross-attention: key and value given apart.
    y = torch.randn(2, 23, 16, dtype=torch.float64)
    cross = layer(x, y, y)
    assert cross.shape == (2, 23, 16) and not torch.allclose(cross, out)


def test_multihead_alibi_attention_state_dict_round_trips_and_seeds_per_step():
    torch.manual_seed(1)
    layer = pt.MultiheadAlibiAttention(16, 4, 2, method="plsh", samples=5, seed=9)
    x = torch.randn(2, 30, 16)
    first, second = layer(x), layer(x)  # two training steps: fresh partitions each
    assert not torch.equal(first, second)
    assert int(layer.attention.training_forwards) == 2
    state = layer.state_dict()
    assert set(state) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias",
                          "attention.training_forwards"}
    torch.manual_seed(2)
    copy = pt.MultiheadAlibiAttention(16, 4, 2, method="plsh", samples=5, seed=9)
    copy.load_state_dict(state)
    assert torch.equal(copy(x), layer(x))  # the third training step of both
    layer.eval()
    copy.eval()
    assert torch.equal(copy(x), layer(x))
    assert int(copy.attention.training_forwards) == 3


@torch.no_grad()
def test_cached_exact_generation_equals_recomputation():
    """Greedy decoding of a small random model of MultiheadAlibiAttention layers (exact ALiBi):
    keys and values of the past kept as tensors and one query per step give the tokens (and,
    to rounding, the logits) of recomputing the whole prefix at every step."""
    torch.manual_seed(3)
    vocabulary, embed, layers = 11, 16, 2
    table = torch.nn.Embedding(vocabulary, embed, dtype=torch.float64)
    blocks = [pt.MultiheadAlibiAttention(embed, 4, 2, method="exact", dtype=torch.float64).eval()
              for _ in range(layers)]

    def full(tokens):
        h = table(torch.tensor([tokens]))
        for block in blocks:
            h = h + block(h)
        return (h @ table.weight.t())[0, -1]

    keys, values = [[] for _ in blocks], [[] for _ in blocks]

    def step(token, position):
        h = table(torch.tensor([[token]]))
        for block, k_list, v_list in zip(blocks, keys, values):
            q, k, v = block.project(h)
            k_list.append(k)
            v_list.append(v)
            out = pt.exact_alibi_attention(q, torch.cat(k_list, 1), torch.cat(v_list, 1),
                                           query_position=position)
            h = h + block.out_proj(out.flatten(-2))
        return (h @ table.weight.t())[0, -1]

    tokens = [1, 4, 2]
    for position, token in enumerate(tokens[:-1]):
        step(token, position)
    for _ in range(40):
        cached = step(tokens[-1], len(tokens) - 1)
        recomputed = full(tokens)
        torch.testing.assert_close(cached, recomputed, rtol=1e-12, atol=1e-12)
        assert int(cached.argmax()) == int(recomputed.argmax())
        tokens.append(int(cached.argmax()))
