"""PyTorch autograd functions and a module on top of plsh's kernels.

The forward and backward passes run plsh's C++ kernels on the tensors' memory (through NumPy views;
no copies for CPU tensors with positive strides and a contiguous last axis). Tensors must be CPU
float32, float64, float16 or bfloat16, all of one dtype; float16 and bfloat16 are computed in
float32 a tile at a time, and the output and the gradients have the inputs' dtype. q
``[B, T, H, D]`` or ``[T, H, D]``, k ``[B, T_k, H_kv, D]``, v ``[B, T_k, H_kv, D_v]`` with H a
multiple of H_kv; the output is ``[B, T, H, D_v]``.

Example (causal self-attention with Positional LSH, 20 draws, gradients through plsh)::

    import torch, plsh.torch
    q, k, v = (torch.randn(2, 1024, 8, 64, requires_grad=True) for _ in range(3))
    out = plsh.torch.plsh_attention(q, k, v, samples=20, seed=0)
    out.square().mean().backward()                    # q.grad, k.grad, v.grad from C++

Slopes of 0 give plain softmax attention ("no positional bias"):
``exact_alibi_attention(q, k, v, slopes=[0.0] * H)``.
"""

import operator as _operator

import numpy as _numpy
import torch as _torch

from . import _plsh

__all__ = [
    "AlibiAttention",
    "exact_alibi_attention",
    "fixed_block_attention",
    "plsh_attention",
    "windowed_alibi_attention",
]

_DTYPES = (_torch.float32, _torch.float64, _torch.float16, _torch.bfloat16)


def _check(name, tensor, like=None):
    """TypeError unless ``tensor`` is a CPU tensor of a dtype of _DTYPES (``like``'s dtype)."""
    if not isinstance(tensor, _torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(tensor).__name__})")
    if tensor.device.type != "cpu":
        raise TypeError(
            f"{name} is on device {tensor.device}; plsh runs on CPU tensors only "
            f"(move it with .cpu())")
    if tensor.dtype not in _DTYPES:
        raise TypeError(
            f"{name} has dtype {tensor.dtype}; plsh takes torch.float32, torch.float64, "
            f"torch.float16 or torch.bfloat16")
    if like is not None and tensor.dtype != like.dtype:
        raise TypeError(
            f"{name} has dtype {tensor.dtype} but q has {like.dtype}; q, k and v must share "
            f"one dtype")
    if tensor.is_sparse or tensor.layout != _torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor")


def _array(tensor):
    """A NumPy array sharing the tensor's memory (a copy only for a conjugated or negated view).

    NumPy has no bfloat16: a bfloat16 tensor becomes a uint16 array of its bit patterns, which the
    kernels read with ``bfloat16=True``.
    """
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.dtype == _torch.bfloat16:
        return tensor.view(_torch.int16).numpy().view(_numpy.uint16)
    return tensor.numpy()


def _check_inputs(q, k, v):
    _check("q", q)
    _check("k", k, q)
    _check("v", v, q)


def _integer(name, value):
    """``value`` as an int: a Python int or an object with ``__index__``; a float or another type
    is a TypeError (never truncated). The range is checked by the kernels."""
    try:
        return _operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer (got {type(value).__name__})") from None


_SEED_LIMIT = 2 ** 64


def _slopes(slopes):
    if slopes is None:
        return None
    if isinstance(slopes, _torch.Tensor):
        slopes = slopes.detach().cpu().tolist()
    return [float(m) for m in slopes]


class _AttentionFunction(_torch.autograd.Function):
    """Attention through a pair of C++ kernels, with autograd.

    ``apply(q, k, v, kernels, parameter, options)``: ``kernels`` is ``(forward, backward)``, for
    example ``(plsh.exact_alibi_attention, plsh.exact_alibi_attention_backward)``; ``parameter``
    the kernels' positional argument after the tensors (the slopes, or the block size of fixed
    blocks); ``options`` their keyword arguments (causal, scale, the positions, and the draws of
    Positional LSH). The backward kernel gets the same parameter and options as the forward, so
    Positional LSH differentiates the forward's own draws.
    """

    @staticmethod
    def forward(ctx, q, k, v, kernels, parameter, options):
        forward_kernel, backward_kernel = kernels
        options = dict(options, bfloat16=q.dtype == _torch.bfloat16)
        out = _torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
        forward_kernel(_array(q), _array(k), _array(v), parameter, out=_array(out), **options)
        ctx.save_for_backward(q, k, v, out)
        ctx.backward_kernel = backward_kernel
        ctx.parameter = parameter
        ctx.options = options
        return out

    @staticmethod
    @_torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        """(dq, dk, dv) from the backward kernel, as new contiguous tensors; None for the
        non-tensor arguments."""
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = (_torch.empty_like(t, memory_format=_torch.contiguous_format)
                      for t in (q, k, v))
        ctx.backward_kernel(_array(q), _array(k), _array(v), _array(out), _array(dout),
                            ctx.parameter, dq=_array(dq), dk=_array(dk), dv=_array(dv),
                            **ctx.options)
        return dq, dk, dv, None, None, None


_EXACT_KERNELS = (_plsh.exact_alibi_attention, _plsh.exact_alibi_attention_backward)
# plsh_attention runs its default kernel, the fused one.
_PLSH_KERNELS = (_plsh.plsh_attention, _plsh.plsh_attention_backward)
_FIXED_BLOCK_KERNELS = (_plsh.fixed_block_attention, _plsh.fixed_block_attention_backward)
_WINDOWED_KERNELS = (_plsh.windowed_alibi_attention, _plsh.windowed_alibi_attention_backward)


def _attention_options(causal, scale, query_position, key_position):
    """The keyword arguments every kernel takes, converted as the kernels expect them."""
    return {"causal": bool(causal), "scale": float(scale),
            "query_position": _integer("query_position", query_position),
            "key_position": _integer("key_position", key_position)}


def exact_alibi_attention(q, k, v, slopes=None, *, causal=True, scale=0.0, query_position=0,
                          key_position=0):
    """Exact ALiBi attention with autograd: softmax(scale q k^T - m_h |i - j|) v per head.

    q ``[B, T, H, D]`` or ``[T, H, D]``, k ``[B, T_k, H_kv, D]``, v ``[B, T_k, H_kv, D_v]``;
    slopes one per query head (None: ``plsh.alibi_slopes(H)``; zeros: no positional bias);
    scale 0 means 1/sqrt(D); query_position and key_position are the absolute positions of the
    first query and key rows. Returns ``[B, T, H, D_v]``.
    """
    _check_inputs(q, k, v)
    slopes = _slopes(slopes)
    options = _attention_options(causal, scale, query_position, key_position)
    return _AttentionFunction.apply(q, k, v, _EXACT_KERNELS, slopes, options)


def windowed_alibi_attention(q, k, v, slopes=None, *, tolerance=1e-6, causal=True, scale=0.0,
                             query_position=0, key_position=0):
    """Windowed ALiBi attention with autograd: exact ALiBi except for keys certified to weigh at
    most ``tolerance``.

    For every query row, the exact-ALiBi attention weight of all the keys the kernel drops is at
    most ``tolerance``, so each output entry is within ``2 * tolerance * max|v|`` of
    :func:`exact_alibi_attention`. The gradients are those of the function computed: exact ALiBi
    over the keys each tile of 64 query rows kept. ``tolerance=0`` is exact ALiBi. Other arguments
    and shapes as :func:`exact_alibi_attention`.
    """
    _check_inputs(q, k, v)
    slopes = _slopes(slopes)
    options = _attention_options(causal, scale, query_position, key_position)
    options.update(tolerance=float(tolerance))
    return _AttentionFunction.apply(q, k, v, _WINDOWED_KERNELS, slopes, options)


def plsh_attention(q, k, v, slopes=None, *, causal=True, scale=0.0, query_position=0,
                   key_position=0, samples=20, seed=0, sampling="independent"):
    """ALiBi attention through Positional LSH with autograd (fused kernel).

    The average of ``samples`` random block partitions per head, the grids
    ``plsh.kernel_grids(slopes, samples, seed, sampling=sampling)``: with ``sampling``
    ``"independent"`` head h uses ``plsh.RandomBinning(slopes[h], plsh.head_seed(seed, h))``;
    ``"latin_hypercube"`` draws the partitions of a head jointly, stratified (lower error at equal
    ``samples``). The same draws serve every batch element and the backward pass. Other arguments
    and shapes as :func:`exact_alibi_attention`.
    """
    _check_inputs(q, k, v)
    slopes = _slopes(slopes)
    options = _attention_options(causal, scale, query_position, key_position)
    options.update(samples=_integer("samples", samples), seed=_integer("seed", seed),
                   sampling=str(sampling))
    return _AttentionFunction.apply(q, k, v, _PLSH_KERNELS, slopes, options)


def fixed_block_attention(q, k, v, block_size, *, causal=True, scale=0.0, query_position=0,
                          key_position=0):
    """Attention within fixed blocks of ``block_size`` absolute positions, with autograd.

    The paper's fixed-blocks baseline: query i attends to the keys j with
    ``i // block_size == j // block_size`` (and ``j <= i`` when causal), without bias. Shapes as
    :func:`exact_alibi_attention`.
    """
    _check_inputs(q, k, v)
    block_size = _integer("block_size", block_size)
    options = _attention_options(causal, scale, query_position, key_position)
    return _AttentionFunction.apply(q, k, v, _FIXED_BLOCK_KERNELS, block_size, options)


class AlibiAttention(_torch.nn.Module):
    """Attention with a positional bias computed by plsh: ``forward(q, k, v) -> out``.

    Shapes as :func:`exact_alibi_attention` (q ``[B, T, H, D]``, k and v ``[B, T_k, H_kv, ...]``).

    method:
      ``"plsh"``   Positional LSH with ``samples`` draws (fused kernel), unbiased for ALiBi,
                   drawn as ``sampling`` says (``"independent"`` or ``"latin_hypercube"``, see
                   :func:`plsh_attention`).
      ``"exact"``  exact ALiBi.
      ``"windowed"`` ALiBi without the keys certified to weigh at most ``tolerance`` (see
                   :func:`windowed_alibi_attention`).
      ``"fixed"``  attention within fixed blocks of ``block_size`` positions.
      ``"none"``   plain causal softmax attention (every slope 0), no positional bias.

    Seeds (method "plsh"): in training mode, forward number t (counted from 0 over the module's
    training forwards) uses ``(seed + t) mod 2**64``, so every training step sees fresh
    partitions; the counter is the buffer ``training_forwards``, saved with the state dict so that
    a resumed run continues the sequence. In eval mode every forward uses ``seed`` itself (fixed
    partitions, deterministic evaluation). The counter advances on every training forward of the
    module that returns (also for the other methods, which ignore it); a forward that raises
    leaves it as it was.

    slopes: one per head, default ``plsh.alibi_slopes(heads)``.
    """

    METHODS = ("plsh", "exact", "windowed", "fixed", "none")
    SAMPLINGS = ("independent", "latin_hypercube")

    def __init__(self, heads, method="plsh", samples=20, block_size=64, seed=0, causal=True,
                 slopes=None, sampling="independent", tolerance=1e-6):
        super().__init__()
        if method not in self.METHODS:
            raise ValueError(f"method must be one of {self.METHODS} (got {method!r})")
        if sampling not in self.SAMPLINGS:
            raise ValueError(f"sampling must be one of {self.SAMPLINGS} (got {sampling!r})")
        heads, samples = _integer("heads", heads), _integer("samples", samples)
        block_size, seed = _integer("block_size", block_size), _integer("seed", seed)
        if heads < 1:
            raise ValueError(f"heads must be at least 1 (got {heads})")
        if samples < 1:
            raise ValueError(f"samples must be at least 1 (got {samples})")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1 (got {block_size})")
        if not 0 <= seed < _SEED_LIMIT:
            raise ValueError(f"seed must lie in [0, 2**64 - 1] (got {seed})")
        tolerance = float(tolerance)
        if not 0 <= tolerance <= 1:
            raise ValueError(f"tolerance must lie in [0, 1] (got {tolerance})")
        self.heads = heads
        self.tolerance = tolerance
        self.method = method
        self.samples = samples
        self.block_size = block_size
        self.seed = seed
        self.causal = bool(causal)
        self.sampling = sampling
        if slopes is None:
            slopes = _plsh.alibi_slopes(self.heads)
        self.slopes = [float(m) for m in slopes]
        if len(self.slopes) != self.heads:
            raise ValueError(f"slopes has {len(self.slopes)} entries, heads is {self.heads}")
        self.register_buffer("training_forwards", _torch.zeros((), dtype=_torch.int64))

    def extra_repr(self):
        return (f"heads={self.heads}, method={self.method!r}, samples={self.samples}, "
                f"block_size={self.block_size}, seed={self.seed}, causal={self.causal}, "
                f"sampling={self.sampling!r}, tolerance={self.tolerance}")

    def current_seed(self):
        """The seed the next forward uses."""
        if self.training:
            return (self.seed + int(self.training_forwards)) % _SEED_LIMIT
        return self.seed

    def forward(self, q, k, v):
        if q.shape[-2] != self.heads:
            raise ValueError(f"q has {q.shape[-2]} heads (shape[-2]), the module {self.heads}")
        seed = self.current_seed()
        if self.method == "plsh":
            out = plsh_attention(q, k, v, self.slopes, causal=self.causal, samples=self.samples,
                                 seed=seed, sampling=self.sampling)
        elif self.method == "exact":
            out = exact_alibi_attention(q, k, v, self.slopes, causal=self.causal)
        elif self.method == "windowed":
            out = windowed_alibi_attention(q, k, v, self.slopes, tolerance=self.tolerance,
                                           causal=self.causal)
        elif self.method == "none":
            out = exact_alibi_attention(q, k, v, [0.0] * self.heads, causal=self.causal)
        else:
            out = fixed_block_attention(q, k, v, self.block_size, causal=self.causal)
        if self.training:
            self.training_forwards += 1
        return out
