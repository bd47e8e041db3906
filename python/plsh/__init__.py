"""plsh: attention with linear biases (ALiBi) through Positional LSH.

The kernels of the plsh C++ library on NumPy arrays ``[tokens, heads, dim]`` or
``[batch, tokens, heads, dim]``, float32, float64 or float16 (or bfloat16 bit patterns in uint16
arrays with ``bfloat16=True``; both 16-bit types computed in float32), read through their
strides without copying when the layout allows. The GIL is released while a kernel runs. C++ argument errors are raised
as ``ValueError`` with the library's message; a wrong dtype is a ``TypeError``.

``plsh.torch`` (imported on its own, ``import plsh.torch``) adds autograd functions and an
``nn.Module`` for PyTorch; ``import plsh`` does not import torch.

>>> import numpy as np, plsh
>>> q = np.ones((16, 4, 8), np.float32)
>>> plsh.plsh_attention(q, q, q, samples=20, seed=0).shape
(16, 4, 8)
"""

from ._plsh import (
    Grid,
    KvCache,
    MaskError,
    RandomBinning,
    alibi_slopes,
    draw_head_grids,
    exact_alibi_attention,
    exact_alibi_attention_backward,
    fixed_block_attention,
    fixed_block_attention_backward,
    head_seed,
    kernel_grids,
    mask_error,
    plsh_attention,
    plsh_attention_backward,
    windowed_alibi_attention,
    windowed_alibi_attention_backward,
)

__all__ = [
    "Grid",
    "KvCache",
    "MaskError",
    "RandomBinning",
    "alibi_slopes",
    "draw_head_grids",
    "exact_alibi_attention",
    "exact_alibi_attention_backward",
    "fixed_block_attention",
    "fixed_block_attention_backward",
    "head_seed",
    "kernel_grids",
    "mask_error",
    "plsh_attention",
    "plsh_attention_backward",
    "windowed_alibi_attention",
    "windowed_alibi_attention_backward",
]
