"""PyTorch autograd functions, a decoding cache and attention modules on top of plsh's kernels.

The forward and backward passes run plsh's C++ kernels on the tensors' memory (through NumPy
views; no copies for CPU tensors with positive strides and a contiguous last axis). Tensors must
be CPU float32, float64, float16 or bfloat16, all of one dtype; float16 and bfloat16 are computed
in float32 a tile at a time, and the output and the gradients have the inputs' dtype.

Layouts: ``layout="bthd"`` (the default, FlashAttention's ``flash_attn_func``): q ``[B, T, H, D]``
or ``[T, H, D]``, k ``[B, T_k, H_kv, D]``, v ``[B, T_k, H_kv, D_v]`` with H a multiple of H_kv
(grouped-query attention), output ``[B, T, H, D_v]``. ``layout="bhtd"`` (PyTorch's
``scaled_dot_product_attention``): every tensor ``[B, H, T, D]``. Both are read through strides
without copies, and the gradients come back in the inputs' layout. A shape that does not fit
raises a ``ValueError`` naming the axes and the layout.

Names follow FlashAttention: ``softmax_scale=None`` means 1/sqrt(D); ``alibi_slopes`` are the
slopes, one per query head. plsh's default differs: ``alibi_slopes=None`` means the standard ALiBi
slopes ``plsh.alibi_slopes(H)`` (Press et al.), and ``[0.0] * H`` is attention without positional
bias. The old names ``slopes=`` and ``scale=`` still work and warn.

Positional LSH defaults to ``plsh.PLSH_DEFAULTS`` (those of the C++ ``PlshOptions``): 100 Latin
hypercube draws per head with the exact factor where it is at least 0.05, the configuration whose
trained models came closest to ALiBi's (docs/training). The paper's estimator is
``samples=20, sampling="independent", near_field=0``.

Example (causal self-attention with Positional LSH, gradients through plsh)::

    import torch, plsh.torch
    q, k, v = (torch.randn(2, 8, 1024, 64, requires_grad=True) for _ in range(3))
    out = plsh.torch.plsh_attention(q, k, v, seed=0, layout="bhtd")
    out.square().mean().backward()                    # q.grad, k.grad, v.grad from C++
"""

import collections as _collections
import math as _math
import operator as _operator
import os as _os
import sys as _sys
import warnings as _warnings
from typing import List, Optional, Sequence, Tuple, Union

import numpy as _numpy
import torch as _torch

from . import _plsh

_DEFAULTS = _plsh.PLSH_DEFAULTS

__all__ = [
    "AlibiAttention",
    "KvCache",
    "MultiheadAlibiAttention",
    "exact_alibi_attention",
    "fixed_block_attention",
    "plsh_attention",
    "truncated_alibi_attention",
    "windowed_alibi_attention",
]

_DTYPES = (_torch.float32, _torch.float64, _torch.float16, _torch.bfloat16)
_LAYOUTS = ("bthd", "bhtd")
_LAYOUT_AXES = {"bthd": "[batch, tokens, heads, dim]", "bhtd": "[batch, heads, tokens, dim]"}

Slopes = Optional[Union[Sequence[float], _torch.Tensor]]


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
    kernels read with ``dtype="bfloat16"``.
    """
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.dtype == _torch.bfloat16:
        return tensor.view(_torch.int16).numpy().view(_numpy.uint16)
    return tensor.numpy()


def _tensor(array, dtype):
    """A tensor of ``dtype`` sharing a kernel's new output ``array`` (for bfloat16, its uint16 bit
    patterns)."""
    if dtype == _torch.bfloat16:
        return _torch.from_numpy(array.view(_numpy.int16)).view(_torch.bfloat16)
    return _torch.from_numpy(array)


def _kernel_dtype(dtype):
    """The kernels' dtype argument for tensors of ``dtype``: "bfloat16" or None (the arrays')."""
    return "bfloat16" if dtype == _torch.bfloat16 else None


def _check_layout(layout):
    if layout not in _LAYOUTS:
        raise ValueError(
            f'layout must be "bthd" ({_LAYOUT_AXES["bthd"]}, FlashAttention\'s) or "bhtd" '
            f'({_LAYOUT_AXES["bhtd"]}, PyTorch SDPA\'s) (got {layout!r})')
    return layout


def _check_inputs(q, k, v, layout):
    _check("q", q)
    _check("k", k, q)
    _check("v", v, q)
    _check_layout(layout)


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


def _renamed(new_name, new_value, old_name, old_value, default=None):
    """``new_value``, or ``old_value`` given under the deprecated name ``old_name`` (a
    DeprecationWarning); a TypeError when both are given."""
    if old_value is _UNSET:
        return new_value
    if new_value is not default:
        raise TypeError(f"pass {new_name}= or its deprecated name {old_name}=, not both")
    _warnings.warn(f"{old_name}= is deprecated; pass {new_name}=", DeprecationWarning,
                   stacklevel=3)
    return old_value


class _Unset:
    def __repr__(self):
        return "<unset>"


_UNSET = _Unset()


def _softmax_scale(softmax_scale, scale):
    softmax_scale = _renamed("softmax_scale", softmax_scale, "scale", scale)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
        if softmax_scale == 0.0:  # the old spelling of the default
            softmax_scale = None
    return softmax_scale


class _AttentionFunction(_torch.autograd.Function):
    """Attention through a pair of C++ kernels, with autograd.

    ``apply(q, k, v, kernels, parameter, options)``: ``kernels`` is ``(forward, backward)``, for
    example ``(plsh.exact_alibi_attention, plsh.exact_alibi_attention_backward)``; ``parameter``
    the kernels' positional argument after the tensors (the slopes, or the block size of fixed
    blocks); ``options`` their keyword arguments (causal, softmax_scale, the positions, the layout
    and the draws of Positional LSH). The backward kernel gets the same parameter and options as
    the forward, so Positional LSH differentiates the forward's own draws, and the forward's row
    log-sum-exp (and the windowed kernel's kept keys), so that it does not compute them again
    (FlashAttention's ``softmax_lse``). The output and the gradients are new contiguous tensors in
    the inputs' layout, on the kernels' new arrays (from 4 MiB on, on Linux with transparent huge
    pages, mappings of their own in huge pages: a step does not fault its outputs in again 4 KiB
    at a time).
    """

    @staticmethod
    def forward(ctx, q, k, v, kernels, parameter, options):
        forward_kernel, backward_kernel = kernels
        options = dict(options, dtype=_kernel_dtype(q.dtype))
        out, lse, *kept = forward_kernel(_array(q), _array(k), _array(v), parameter,
                                         return_lse=True, **options)
        out = _tensor(out, q.dtype)
        # lse among the saved tensors, so that activation checkpointing drops and recomputes it
        # with the others; the kept keys (windowed) are O(B H T / 64) and stay on ctx.
        ctx.save_for_backward(q, k, v, out, _torch.from_numpy(lse))
        ctx.kept = {"kept": kept[0]} if kept else {}
        ctx.backward_kernel = backward_kernel
        ctx.parameter = parameter
        ctx.options = options
        return out

    @staticmethod
    @_torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        """(dq, dk, dv) from the backward kernel, as new contiguous tensors in the inputs' layout;
        None for the non-tensor arguments."""
        q, k, v, out, lse = ctx.saved_tensors
        gradients = ctx.backward_kernel(_array(q), _array(k), _array(v), _array(out),
                                        _array(dout), ctx.parameter, lse=lse.numpy(),
                                        **ctx.kept, **ctx.options)
        return (*(_tensor(gradient, q.dtype) for gradient in gradients), None, None, None)


_EXACT_KERNELS = (_plsh.exact_alibi_attention, _plsh.exact_alibi_attention_backward)
# plsh_attention runs its default kernel, the fused one.
_PLSH_KERNELS = (_plsh.plsh_attention, _plsh.plsh_attention_backward)
_FIXED_BLOCK_KERNELS = (_plsh.fixed_block_attention, _plsh.fixed_block_attention_backward)
_WINDOWED_KERNELS = (_plsh.windowed_alibi_attention, _plsh.windowed_alibi_attention_backward)
_TRUNCATED_KERNELS = (_plsh.truncated_alibi_attention, _plsh.truncated_alibi_attention_backward)


def _attention_options(causal, softmax_scale, query_position, key_position, layout):
    """The keyword arguments every kernel takes, converted as the kernels expect them."""
    return {"causal": bool(causal), "softmax_scale": softmax_scale,
            "query_position": _integer("query_position", query_position),
            "key_position": _integer("key_position", key_position), "layout": layout}


def exact_alibi_attention(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor,
                          alibi_slopes: Slopes = None, *, causal: bool = True,
                          softmax_scale: Optional[float] = None, query_position: int = 0,
                          key_position: int = 0, layout: str = "bthd", slopes=_UNSET,
                          scale=_UNSET) -> _torch.Tensor:
    """Exact ALiBi attention with autograd: softmax(softmax_scale q k^T - m_h |i - j|) v per head.

    Args:
      q, k, v: ``[B, T, H, D]``, ``[B, T_k, H_kv, D]``, ``[B, T_k, H_kv, D_v]`` (layout "bthd",
        the batch axis optional) or ``[B, H, T, D]`` ... (layout "bhtd"); H a multiple of H_kv.
      alibi_slopes: one slope per query head; None (plsh's default) means the standard slopes
        ``plsh.alibi_slopes(H)``, ``[0.0] * H`` no positional bias.
      causal: keys after the query are masked.
      softmax_scale: None means 1/sqrt(D).
      query_position, key_position: absolute positions of the first query and key rows.
      layout: "bthd" or "bhtd" (PyTorch SDPA's), for every tensor and the gradients.

    Returns:
      The output ``[B, T, H, D_v]`` (or ``[B, H, T, D_v]`` in layout "bhtd").
    """
    _check_inputs(q, k, v, layout)
    alibi_slopes = _slopes(_renamed("alibi_slopes", alibi_slopes, "slopes", slopes))
    options = _attention_options(causal, _softmax_scale(softmax_scale, scale), query_position,
                                 key_position, layout)
    return _AttentionFunction.apply(q, k, v, _EXACT_KERNELS, alibi_slopes, options)


def windowed_alibi_attention(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor,
                             alibi_slopes: Slopes = None, *, tolerance: float = 1e-6,
                             causal: bool = True, softmax_scale: Optional[float] = None,
                             query_position: int = 0, key_position: int = 0,
                             layout: str = "bthd", slopes=_UNSET,
                             scale=_UNSET) -> _torch.Tensor:
    """Windowed ALiBi attention with autograd: exact ALiBi except for keys certified to weigh at
    most ``tolerance``.

    For every query row, the exact-ALiBi attention weight of all the keys the kernel drops is at
    most ``tolerance``, so each output entry is within ``2 * tolerance * max|v|`` of
    :func:`exact_alibi_attention`. The gradients are those of the function computed: exact ALiBi
    over the keys each tile of 64 query rows kept. ``tolerance=0`` is exact ALiBi. Other arguments
    and shapes as :func:`exact_alibi_attention`.
    """
    _check_inputs(q, k, v, layout)
    alibi_slopes = _slopes(_renamed("alibi_slopes", alibi_slopes, "slopes", slopes))
    options = _attention_options(causal, _softmax_scale(softmax_scale, scale), query_position,
                                 key_position, layout)
    options.update(tolerance=float(tolerance))
    return _AttentionFunction.apply(q, k, v, _WINDOWED_KERNELS, alibi_slopes, options)


def truncated_alibi_attention(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor,
                              alibi_slopes: Slopes, factor_tolerance: float, *,
                              causal: bool = True, softmax_scale: Optional[float] = None,
                              query_position: int = 0, key_position: int = 0,
                              layout: str = "bthd") -> _torch.Tensor:
    """ALiBi attention truncated where the factor falls below ``factor_tolerance``, with autograd.

    Head h keeps the keys with ``|i - j| <= floor(ln(1 / factor_tolerance) / m_h)``, where the
    factor ``exp(-m_h |i - j|)`` is at least ``factor_tolerance``, and drops the others whatever
    their scores: no bound on the error against :func:`exact_alibi_attention` (a far key of high
    score keeps a large weight under exact ALiBi); :func:`windowed_alibi_attention` is the kernel
    whose tolerance is a guarantee. The gradients are those of the function computed: exact
    ALiBi's over each head's band, zero from the keys outside it. ``factor_tolerance`` in [0, 1];
    0 is exact ALiBi. ``alibi_slopes`` and ``factor_tolerance`` are required (``alibi_slopes=None``
    means the standard slopes). Other arguments and shapes as :func:`exact_alibi_attention`.
    """
    _check_inputs(q, k, v, layout)
    options = _attention_options(causal, _softmax_scale(softmax_scale, _UNSET), query_position,
                                 key_position, layout)
    options.update(factor_tolerance=float(factor_tolerance))
    return _AttentionFunction.apply(q, k, v, _TRUNCATED_KERNELS, _slopes(alibi_slopes), options)


def plsh_attention(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor,
                   alibi_slopes: Slopes = None, *, causal: bool = True,
                   softmax_scale: Optional[float] = None, query_position: int = 0,
                   key_position: int = 0, samples: int = _DEFAULTS["samples"], seed: int = 0,
                   sampling: str = _DEFAULTS["sampling"],
                   near_field: float = _DEFAULTS["near_field"], layout: str = "bthd",
                   slopes=_UNSET, scale=_UNSET) -> _torch.Tensor:
    """ALiBi attention through Positional LSH with autograd (fused kernel).

    The average of ``samples`` random block partitions per head, the grids
    ``plsh.kernel_grids(alibi_slopes, samples, seed, sampling=sampling)``: with ``sampling``
    ``"independent"`` head h uses ``plsh.RandomBinning(alibi_slopes[h], plsh.head_seed(seed, h))``;
    ``"latin_hypercube"`` draws the partitions of a head jointly, stratified (lower error at equal
    ``samples``). ``near_field`` f in [0, 1] takes the exact factor ``exp(-m_h |i - j|)`` where it
    is at least f and the partitions beyond: the same mean, no variance near the diagonal, where
    the steep heads put their weight (0: partitions everywhere). The same draws serve every batch
    element and the backward pass. Other arguments and shapes as :func:`exact_alibi_attention`.
    """
    _check_inputs(q, k, v, layout)
    alibi_slopes = _slopes(_renamed("alibi_slopes", alibi_slopes, "slopes", slopes))
    options = _attention_options(causal, _softmax_scale(softmax_scale, scale), query_position,
                                 key_position, layout)
    options.update(samples=_integer("samples", samples), seed=_integer("seed", seed),
                   sampling=str(sampling), near_field=_near_field(near_field))
    return _AttentionFunction.apply(q, k, v, _PLSH_KERNELS, alibi_slopes, options)


def fixed_block_attention(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, block_size: int,
                          *, causal: bool = True, softmax_scale: Optional[float] = None,
                          query_position: int = 0, key_position: int = 0, layout: str = "bthd",
                          scale=_UNSET) -> _torch.Tensor:
    """Attention within fixed blocks of ``block_size`` absolute positions, with autograd.

    The paper's fixed-blocks baseline: query i attends to the keys j with
    ``i // block_size == j // block_size`` (and ``j <= i`` when causal), without bias. Shapes and
    other arguments as :func:`exact_alibi_attention`.
    """
    _check_inputs(q, k, v, layout)
    block_size = _integer("block_size", block_size)
    options = _attention_options(causal, _softmax_scale(softmax_scale, scale), query_position,
                                 key_position, layout)
    return _AttentionFunction.apply(q, k, v, _FIXED_BLOCK_KERNELS, block_size, options)


def _near_field(near_field):
    """``near_field`` as a float in [0, 1], else a ValueError."""
    value = float(near_field)
    if not 0 <= value <= 1:
        raise ValueError(f"near_field must lie in [0, 1] (got {near_field})")
    return value


def _heads_axis(tensor, layout):
    """The index of the heads axis of ``tensor`` in ``layout`` (from the end: -2 or -3)."""
    return tensor.dim() + (-2 if layout == "bthd" else -3)


def _axis_text(tensor, layout, axis):
    axes = _LAYOUT_AXES[layout] if tensor.dim() == 4 else _LAYOUT_AXES[layout].replace(
        "batch, ", "")
    return f'axis {axis} of layout "{layout}" {axes}'


# torch.utils.checkpoint's source file, and the functions in it that re-run a checkpointed
# forward during the backward: CheckpointFunction.backward (use_reentrant=True), the saved tensors'
# unpack hook (use_reentrant=False; recompute_fn in newer releases).
_CHECKPOINT_FILE = _os.path.join("torch", "utils", "checkpoint.py")
_RECOMPUTING_FUNCTIONS = ("backward", "unpack", "recompute_fn", "unpack_hook")
# Checkpointed training forwards whose seeds a module keeps for their recomputation.
_CHECKPOINTED_FORWARDS = 256


def _checkpoint_phase():
    """None outside torch.utils.checkpoint, "recompute" inside its re-run of a forward during
    the backward, "forward" inside a checkpointed forward otherwise (read from the call stack)."""
    frame = _sys._getframe(1)
    phase = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_CHECKPOINT_FILE):
            if code.co_name in _RECOMPUTING_FUNCTIONS:
                return "recompute"
            phase = "forward"
        frame = frame.f_back
    return phase


class AlibiAttention(_torch.nn.Module):
    """Attention with a positional bias computed by plsh: ``forward(q, k, v) -> out``.

    Shapes as :func:`exact_alibi_attention` in the module's ``layout`` (q ``[B, T, H, D]``, k and
    v ``[B, T_k, H_kv, ...]`` for "bthd"; ``[B, H, T, D]`` for "bhtd"). A q whose heads axis does
    not hold ``heads`` heads raises a ``ValueError`` naming the axis.

    method:
      ``"plsh"``   Positional LSH with ``samples`` draws (fused kernel), unbiased for ALiBi,
                   drawn as ``sampling`` says (``"independent"`` or ``"latin_hypercube"``), with
                   the exact factor where it is at least ``near_field`` (see
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

    Activation checkpointing: a forward that ``torch.utils.checkpoint`` runs again during the
    backward (either ``use_reentrant``) uses the seed of the forward it recomputes and does not
    advance the counter, so the gradients are those of the partitions that made the output, and
    the counter counts training steps. It finds that forward by one number drawn from torch's
    default CPU generator in each checkpointed training forward (as dropout draws its mask), which
    the recomputation draws again because checkpointing restores the generator's state
    (``preserve_rng_state=True``, its default). A recomputation that draws a number no checkpointed
    forward drew (``preserve_rng_state=False``) raises a ``RuntimeError`` instead of differentiating
    other partitions. Forwards outside checkpointing draw nothing from torch's generators.

    alibi_slopes: one per head, default (None) ``plsh.alibi_slopes(heads)``; ``slopes=`` is its
    deprecated name.
    """

    METHODS = ("plsh", "exact", "windowed", "fixed", "none")
    SAMPLINGS = ("independent", "latin_hypercube")

    def __init__(self, heads: int, method: str = "plsh", samples: int = _DEFAULTS["samples"],
                 block_size: int = 64, seed: int = 0, causal: bool = True,
                 alibi_slopes: Slopes = None,
                 sampling: str = _DEFAULTS["sampling"], tolerance: float = 1e-6, *,
                 near_field: float = _DEFAULTS["near_field"],
                 softmax_scale: Optional[float] = None,
                 layout: str = "bthd", slopes=_UNSET):
        super().__init__()
        alibi_slopes = _renamed("alibi_slopes", alibi_slopes, "slopes", slopes)
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
        self.near_field = _near_field(near_field)
        self.tolerance = tolerance
        self.method = method
        self.samples = samples
        self.block_size = block_size
        self.seed = seed
        self.causal = bool(causal)
        self.sampling = sampling
        self.softmax_scale = _softmax_scale(softmax_scale, _UNSET)
        self.layout = _check_layout(layout)
        if alibi_slopes is None:
            alibi_slopes = _plsh.alibi_slopes(self.heads)
        self.alibi_slopes = _slopes(alibi_slopes)
        if len(self.alibi_slopes) != self.heads:
            raise ValueError(f"alibi_slopes has {len(self.alibi_slopes)} entries, one per head "
                             f"expected: heads is {self.heads}")
        self.register_buffer("training_forwards", _torch.zeros((), dtype=_torch.int64))
        # The seeds of the latest checkpointed training forwards, by the number each one drew.
        self._checkpointed_seeds = _collections.OrderedDict()

    @property
    def slopes(self) -> List[float]:
        """The slopes (the older name of ``alibi_slopes``)."""
        return self.alibi_slopes

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, method={self.method!r}, samples={self.samples}, "
                f"block_size={self.block_size}, seed={self.seed}, causal={self.causal}, "
                f"sampling={self.sampling!r}, near_field={self.near_field}, "
                f"tolerance={self.tolerance}, layout={self.layout!r}")

    def current_seed(self) -> int:
        """The seed the next forward uses (outside a checkpoint's recomputation)."""
        if self.training:
            return (self.seed + int(self.training_forwards)) % _SEED_LIMIT
        return self.seed

    def _training_seed(self):
        """(seed of this training forward, whether it is a new forward that advances the
        counter): a checkpoint's recomputation takes the seed of the forward it recomputes."""
        phase = _checkpoint_phase()
        if phase is None:
            return self.current_seed(), True
        tag = int(_torch.randint(0, 2 ** 62, ()))
        if phase == "forward":
            seed = self.current_seed()
            self._checkpointed_seeds[tag] = seed
            while len(self._checkpointed_seeds) > _CHECKPOINTED_FORWARDS:
                self._checkpointed_seeds.popitem(last=False)
            return seed, True
        if tag not in self._checkpointed_seeds:
            raise RuntimeError(
                "AlibiAttention: a torch.utils.checkpoint recomputation whose forward this module "
                "did not see: its partitions cannot be reproduced (checkpoint with "
                "preserve_rng_state=True, the default)")
        return self._checkpointed_seeds.pop(tag), False

    def forward(self, q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor) -> _torch.Tensor:
        """Attention of q over k and v, in the module's layout."""
        if isinstance(q, _torch.Tensor) and q.dim() in (3, 4):
            axis = _heads_axis(q, self.layout)
            if q.shape[axis] != self.heads:
                hint = ('; tensors in PyTorch SDPA\'s order [batch, heads, tokens, dim] need '
                        'layout="bhtd"' if self.layout == "bthd" else "")
                raise ValueError(
                    f"q has {q.shape[axis]} heads ({_axis_text(q, self.layout, axis)}) but the "
                    f"module has {self.heads}{hint}")
        options = dict(causal=self.causal, softmax_scale=self.softmax_scale, layout=self.layout)
        seed, new_forward = self._training_seed() if self.training else (self.seed, False)
        if self.method == "plsh":
            out = plsh_attention(q, k, v, self.alibi_slopes, samples=self.samples, seed=seed,
                                 sampling=self.sampling, near_field=self.near_field, **options)
        elif self.method == "exact":
            out = exact_alibi_attention(q, k, v, self.alibi_slopes, **options)
        elif self.method == "windowed":
            out = windowed_alibi_attention(q, k, v, self.alibi_slopes, tolerance=self.tolerance,
                                           **options)
        elif self.method == "none":
            out = exact_alibi_attention(q, k, v, [0.0] * self.heads, **options)
        else:
            out = fixed_block_attention(q, k, v, self.block_size, **options)
        if new_forward:
            self.training_forwards += 1
        return out


class MultiheadAlibiAttention(_torch.nn.Module):
    """Multi-head attention with ALiBi by plsh, with the projections of
    ``nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)``.

    ``forward(query, key=None, value=None) -> [B, T, embed_dim]`` with query ``[B, T, embed_dim]``
    (or ``[T, embed_dim]``), key and value ``[B, T_k, embed_dim]`` (default: the query, which is
    self-attention). Unlike ``nn.MultiheadAttention`` it returns the output only (plsh never forms
    the attention weights) and it is causal unless ``causal=False``.

    Parameters, named as ``nn.MultiheadAttention``'s: ``in_proj_weight``
    ``[(num_heads + 2 num_kv_heads) head_dim, embed_dim]`` (the rows of q, then k, then v),
    ``in_proj_bias`` (if ``bias``) and ``out_proj`` (an ``nn.Linear(embed_dim, embed_dim)``),
    with ``head_dim = embed_dim // num_heads``. Both projections are initialised as
    ``nn.Linear`` initialises its parameters (``nn.MultiheadAttention`` uses Xavier).

    num_kv_heads: the heads of k and v (grouped-query attention), a divisor of ``num_heads``;
    None means ``num_heads``.

    The attention is ``self.attention``: by default ``AlibiAttention(num_heads, method, ...)`` with
    the other arguments (see :class:`AlibiAttention`: the methods, and the seeds of Positional LSH,
    fresh at every training forward and fixed in eval mode, counted by the buffer
    ``attention.training_forwards``). ``attention=`` replaces it by any module that maps q, k, v
    ``[B, T, H, D]`` to ``[B, T, H, D]``.

    Example::

        layer = plsh.torch.MultiheadAlibiAttention(512, 8, num_kv_heads=2, method="plsh")
        y = layer(torch.randn(4, 1024, 512))                  # [4, 1024, 512]
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 method: str = "plsh", *, bias: bool = True, samples: int = _DEFAULTS["samples"],
                 block_size: int = 64, seed: int = 0, causal: bool = True,
                 alibi_slopes: Slopes = None, sampling: str = _DEFAULTS["sampling"],
                 tolerance: float = 1e-6, near_field: float = _DEFAULTS["near_field"],
                 softmax_scale: Optional[float] = None,
                 attention: Optional[_torch.nn.Module] = None, device=None, dtype=None):
        super().__init__()
        embed_dim, num_heads = _integer("embed_dim", embed_dim), _integer("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else _integer("num_kv_heads",
                                                                         num_kv_heads)
        if num_heads < 1 or embed_dim < 1:
            raise ValueError(f"embed_dim and num_heads must be at least 1 (got {embed_dim} and "
                             f"{num_heads})")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be a multiple of num_heads "
                             f"({num_heads})")
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        factory = {"device": device, "dtype": dtype}
        rows = (num_heads + 2 * num_kv_heads) * self.head_dim
        self.in_proj_weight = _torch.nn.Parameter(_torch.empty(rows, embed_dim, **factory))
        if bias:
            self.in_proj_bias = _torch.nn.Parameter(_torch.empty(rows, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self._reset_in_projection()
        self.out_proj = _torch.nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if attention is None:
            attention = AlibiAttention(num_heads, method, samples, block_size, seed, causal,
                                       alibi_slopes, sampling, tolerance, near_field=near_field,
                                       softmax_scale=softmax_scale)
        self.attention = attention

    def _reset_in_projection(self):
        """The initialisation of nn.Linear (Kaiming uniform weights, uniform bias of bound
        1/sqrt(fan_in)), drawn in the same order from the same generator."""
        _torch.nn.init.kaiming_uniform_(self.in_proj_weight, a=_math.sqrt(5))
        if self.in_proj_bias is not None:
            bound = 1 / _math.sqrt(self.embed_dim)
            _torch.nn.init.uniform_(self.in_proj_bias, -bound, bound)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}")

    def project(self, query: _torch.Tensor, key: Optional[_torch.Tensor] = None,
                value: Optional[_torch.Tensor] = None):
        """(q, k, v) ``[B, T, H, D]``, ``[B, T_k, H_kv, D]``, ``[B, T_k, H_kv, D]``: the input
        projections (strided views of one product for self-attention)."""
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if tensor is not None and tensor.shape[-1] != self.embed_dim:
                raise ValueError(f"{name} has {tensor.shape[-1]} features on its last axis "
                                 f"(embed), the module embed_dim {self.embed_dim}")
        q_rows = self.num_heads * self.head_dim
        kv_rows = self.num_kv_heads * self.head_dim
        weight, bias = self.in_proj_weight, self.in_proj_bias
        if (key is None or key is query) and (value is None or value is query):
            projected = _torch.nn.functional.linear(query, weight, bias)
            q, k, v = projected.split([q_rows, kv_rows, kv_rows], dim=-1)
        else:
            key = query if key is None else key
            value = key if value is None else value
            w_q, w_k, w_v = weight.split([q_rows, kv_rows, kv_rows])
            b_q, b_k, b_v = (None,) * 3 if bias is None else bias.split([q_rows, kv_rows,
                                                                          kv_rows])
            q = _torch.nn.functional.linear(query, w_q, b_q)
            k = _torch.nn.functional.linear(key, w_k, b_k)
            v = _torch.nn.functional.linear(value, w_v, b_v)
        return (q.unflatten(-1, (self.num_heads, self.head_dim)),
                k.unflatten(-1, (self.num_kv_heads, self.head_dim)),
                v.unflatten(-1, (self.num_kv_heads, self.head_dim)))

    def forward(self, query: _torch.Tensor, key: Optional[_torch.Tensor] = None,
                value: Optional[_torch.Tensor] = None) -> _torch.Tensor:
        """out_proj(attention(q, k, v)) with q, k, v from :meth:`project`."""
        q, k, v = self.project(query, key, value)
        out = self.attention(q, k, v)
        return self.out_proj(out.flatten(-2))


def _numpy_dtype(dtype):
    """The KvCache dtype argument of plsh._plsh for a torch dtype."""
    table = {_torch.float32: _numpy.float32, _torch.float64: _numpy.float64,
             _torch.float16: _numpy.float16, _torch.bfloat16: "bfloat16"}
    if dtype not in table:
        raise TypeError(f"dtype must be torch.float32, torch.float64, torch.float16 or "
                        f"torch.bfloat16 (got {dtype})")
    return table[dtype]


class _Cache:
    """What :class:`KvCache` and :class:`AlibiKvCache` share: a decoding cache of plsh._plsh
    (``_cache``, made by the subclass with ``_numpy_dtype(dtype)``) on torch tensors of one
    ``dtype`` in one ``layout``.

    Tensors: CPU, of the cache's ``dtype`` (torch.float32, float64, float16 or bfloat16), in the
    cache's ``layout``: "bthd" ``[T, H, D]`` or ``[1, T, H, D]``, "bhtd" ``[H, T, D]`` or
    ``[1, H, T, D]``; read in place (no copy) and returned as new tensors of the same rank and
    layout. No autograd: the caches are for inference.
    """

    def __init__(self, layout, dtype):
        self.layout = _check_layout(layout)
        self.dtype = dtype

    def _view(self, name, tensor):
        """The [tokens, heads, dim] NumPy view of ``tensor`` and whether it had a batch axis."""
        _check(name, tensor)
        if tensor.dtype != self.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype}, the cache {self.dtype}")
        batched = tensor.dim() == 4
        if batched:
            if tensor.shape[0] != 1:
                raise ValueError(f"{name} has batch {tensor.shape[0]} (axis 0 of layout "
                                 f'"{self.layout}" {_LAYOUT_AXES[self.layout]}); a KvCache '
                                 f"holds one sequence, batch 1")
            tensor = tensor[0]
        elif tensor.dim() != 3:
            raise ValueError(f"{name} must have 3 or 4 dimensions {_LAYOUT_AXES[self.layout]} "
                             f"(got {tensor.dim()})")
        if self.layout == "bhtd":
            tensor = tensor.transpose(0, 1)
        return tensor, batched

    def _output(self, q, batched):
        """A new output tensor for the queries ``q`` ([T, H, D]) in the caller's layout, and the
        [T, H, D_v] array the kernel writes."""
        shape = (q.shape[0], q.shape[1], self._cache.value_dim)
        if self.layout == "bhtd":
            out = _torch.empty((shape[1], shape[0], shape[2]), dtype=self.dtype)
            target = out.transpose(0, 1)
        else:
            out = _torch.empty(shape, dtype=self.dtype)
            target = out
        return (out.unsqueeze(0) if batched else out), _array(target)

    def append(self, k: _torch.Tensor, v: _torch.Tensor) -> None:
        """Appends the keys and values of positions ``position .. position + n - 1``."""
        k, _ = self._view("k", k)
        v, _ = self._view("v", v)
        self._cache.append(_array(k), _array(v))

    def attend(self, q: _torch.Tensor) -> _torch.Tensor:
        """The outputs of the queries ``q`` at positions ``position - n .. position - 1``."""
        q, batched = self._view("q", q)
        out, target = self._output(q, batched)
        self._cache.attend(_array(q), out=target)
        return out

    def decode(self, q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor) -> _torch.Tensor:
        """One decoding step: ``append(k, v)`` then ``attend(q)``; arguments that fail their
        checks (a ``ValueError`` or ``TypeError``) leave the cache as it was."""
        q, batched = self._view("q", q)
        k, _ = self._view("k", k)
        v, _ = self._view("v", v)
        out, target = self._output(q, batched)
        self._cache.decode(_array(q), _array(k), _array(v), out=target)
        return out

    @property
    def position(self) -> int:
        """The position of the next appended token."""
        return self._cache.position

    @property
    def heads(self) -> int:
        return self._cache.heads

    @property
    def kv_heads(self) -> int:
        return self._cache.kv_heads

    @property
    def dim(self) -> int:
        return self._cache.dim

    @property
    def value_dim(self) -> int:
        return self._cache.value_dim

    @property
    def alibi_slopes(self) -> List[float]:
        return self._cache.alibi_slopes

    @property
    def options(self) -> dict:
        """The options the cache was made with (softmax_scale 0: 1/sqrt(dim))."""
        return self._cache.options

    def _repr_extra(self) -> str:
        return ""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(heads={self.heads}, kv_heads={self.kv_heads}, "
                f"dim={self.dim}, value_dim={self.value_dim}, dtype={self.dtype}, "
                f"layout={self.layout!r}, position={self.position}, resident={self.resident}"
                f"{self._repr_extra()})")


class KvCache(_Cache):
    """The key/value cache of :class:`plsh.KvCache` on torch tensors: incremental causal
    decoding with Positional LSH that forgets the keys no later query can reach.

    Tensors: CPU, of the cache's ``dtype`` (torch.float32, float64, float16 or bfloat16), in the
    cache's ``layout``: "bthd" ``[T, H, D]`` or ``[1, T, H, D]``, "bhtd" ``[H, T, D]`` or
    ``[1, H, T, D]``; read in place (no copy) and returned as new tensors of the same rank and
    layout. No autograd: the cache is for inference.

    ``append(k, v)`` adds the keys and values of the next positions; ``attend(q)`` returns the
    outputs of the queries at the newest positions; ``decode(q, k, v)`` does both in one step (a
    call that raises leaves the cache as it was). ``keys()`` and ``values()`` return the resident
    rows; ``position``, ``resident``, ``oldest_position`` and ``bytes`` (the resident size of the
    buffers) describe the cache; ``options``: samples, seed, sampling, near_field, kernel,
    softmax_scale (0: 1/sqrt(dim)) and key_position.

    Arguments as :class:`plsh.KvCache` (``alibi_slopes`` None means the standard slopes,
    ``softmax_scale`` None means 1/sqrt(dim)); ``value_dim`` None means ``dim``.
    """

    def __init__(self, heads: int, kv_heads: int, dim: int, value_dim: Optional[int] = None,
                 alibi_slopes: Slopes = None, *, samples: int = _DEFAULTS["samples"],
                 seed: int = 0, sampling: str = _DEFAULTS["sampling"],
                 near_field: float = _DEFAULTS["near_field"],
                 softmax_scale: Optional[float] = None, key_position: int = 0,
                 kernel: str = "fused",
                 dtype: _torch.dtype = _torch.float32, layout: str = "bthd"):
        super().__init__(layout, dtype)
        value_dim = dim if value_dim is None else value_dim
        self._cache = _plsh.KvCache(heads, kv_heads, dim, value_dim, _slopes(alibi_slopes),
                                    samples=samples, seed=seed, sampling=sampling,
                                    near_field=_near_field(near_field),
                                    softmax_scale=softmax_scale, key_position=key_position,
                                    kernel=kernel, dtype=_numpy_dtype(dtype))

    def _tensor(self, array):
        if self.dtype == _torch.bfloat16:  # torch reads uint16 arrays as int16 only
            tensor = _torch.from_numpy(array.view(_numpy.int16)).view(_torch.bfloat16)
        else:
            tensor = _torch.from_numpy(array)
        return tensor.transpose(0, 1).contiguous() if self.layout == "bhtd" else tensor

    def keys(self) -> _torch.Tensor:
        """A copy of the resident keys, ``[resident, kv_heads, dim]`` (or ``[kv_heads, resident,
        dim]`` in layout "bhtd")."""
        return self._tensor(self._cache.keys())

    def values(self) -> _torch.Tensor:
        """A copy of the resident values, as :meth:`keys`."""
        return self._tensor(self._cache.values())

    @property
    def resident(self) -> int:
        """The tokens whose keys and values the cache holds."""
        return self._cache.resident

    @property
    def oldest_position(self) -> int:
        """The position of the oldest resident token."""
        return self._cache.oldest_position

    @property
    def bytes(self) -> int:
        """Bytes of the key and value buffers (resident rows and room for later appends)."""
        return self._cache.bytes


class AlibiKvCache(_Cache):
    """The key/value cache of :class:`plsh.AlibiKvCache` on torch tensors: decoding a model
    trained with exact ALiBi in bounded memory, with a certified bound per row on the exact-ALiBi
    weight of the keys it dropped.

    Key/value head g keeps the newest ``W_g = ceil(ln(1 + exp(max_score - min_logit) /
    tolerance) / m_g)`` positions (``windows``) and pins the ``sinks`` keys of largest norm that
    left that window; the other keys are dropped, and what they can weigh is bounded at every step
    from their norms. When ``|softmax_scale| |q| |k| <= max_score`` for the keys a row drops and
    ``softmax_scale q.k >= min_logit`` within its window, every row's bound is at most
    ``tolerance``, and its output is within ``2 * bound * max|v|`` of exact ALiBi over the whole
    prefix. After each ``attend`` or ``decode``: ``bound`` (the largest over the step's rows and
    heads), ``certified`` (``bound <= tolerance``) and ``bounds`` (``[T, H]``, float64); with
    ``strict=True`` a step whose bound exceeds the tolerance raises :class:`plsh.CertificateError`
    after it is taken. ``options``: tolerance, max_score, min_logit, sinks, strict, softmax_scale
    (0: 1/sqrt(dim)) and key_position.

    Tensors as :class:`KvCache`: CPU, of the cache's ``dtype``, in its ``layout`` ("bthd" ``[T, H,
    D]`` or ``[1, T, H, D]``, "bhtd" ``[H, T, D]`` or ``[1, H, T, D]``); no autograd.
    """

    def __init__(self, heads: int, kv_heads: int, dim: int, value_dim: Optional[int] = None,
                 alibi_slopes: Slopes = None, *, tolerance: float = 1e-4,
                 max_score: float = 16.0, min_logit: float = -16.0, sinks: int = 4,
                 strict: bool = False, softmax_scale: Optional[float] = None,
                 key_position: int = 0, dtype: _torch.dtype = _torch.float32,
                 layout: str = "bthd"):
        super().__init__(layout, dtype)
        value_dim = dim if value_dim is None else value_dim
        self._cache = _plsh.AlibiKvCache(heads, kv_heads, dim, value_dim, _slopes(alibi_slopes),
                                         tolerance=tolerance, max_score=max_score,
                                         min_logit=min_logit, sinks=sinks, strict=strict,
                                         softmax_scale=softmax_scale, key_position=key_position,
                                         dtype=_numpy_dtype(dtype))

    @property
    def bound(self) -> float:
        """The largest bound of the last step: an upper bound on the exact-ALiBi weight, over the
        whole prefix, of the keys a row did not attend."""
        return self._cache.bound

    @property
    def certified(self) -> bool:
        """Whether the last step's bound is at most the tolerance."""
        return self._cache.certified

    @property
    def bounds(self) -> _torch.Tensor:
        """The bound of every row and head of the last step, ``[T, H]`` float64."""
        return _torch.from_numpy(self._cache.bounds)

    @property
    def windows(self) -> List[int]:
        """``W_g`` of each key/value head (``2**63 - 1``: every key kept)."""
        return self._cache.windows

    def oldest_position(self, kv_head: int) -> int:
        """The first position of the window of a key/value head."""
        return self._cache.oldest_position(kv_head)

    def pinned_positions(self, kv_head: int) -> List[int]:
        """The positions of the pinned keys of a key/value head, oldest first."""
        return self._cache.pinned_positions(kv_head)

    @property
    def resident(self) -> int:
        """The most rows (window and pinned keys) a key/value head holds."""
        return self._cache.resident

    @property
    def resident_per_head(self) -> List[int]:
        """The rows each key/value head holds."""
        return self._cache.resident_per_head

    @property
    def bytes(self) -> int:
        """Bytes of the rows held and of the blocks of dropped positions."""
        return self._cache.bytes

    def _repr_extra(self) -> str:
        return f", windows={self.windows}"


__all__ += ["AlibiKvCache"]
