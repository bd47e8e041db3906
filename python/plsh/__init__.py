"""plsh: attention with linear biases (ALiBi) through Positional LSH.

The kernels of the plsh C++ library on NumPy arrays ``[batch, tokens, heads, dim]`` (layout
"bthd", FlashAttention's) or ``[batch, heads, tokens, dim]`` (``layout="bhtd"``, PyTorch SDPA's),
the batch axis optional, float32, float64 or float16 (or bfloat16 bit patterns in uint16 arrays
with ``dtype="bfloat16"``, as in ``KvCache``; both 16-bit types computed in float32), read through
their strides without copying when the layout allows. ``softmax_scale=None`` means 1/sqrt(dim);
``alibi_slopes=None`` means the standard slopes ``alibi_slopes(heads)``. The GIL is released
while a kernel runs. C++ argument errors and shapes that do not fit are raised as ``ValueError``
naming the axes; a wrong dtype is a ``TypeError``. A forward called with ``return_lse=True``
also returns its row log-sum-exp (and, windowed, its ``KeptKeys``), which its backward takes as
``lse=`` (and ``kept=``) instead of computing them again. ``__version__`` is the plsh project's
version; ``PLSH_DEFAULTS`` the defaults of the Positional LSH estimator (``samples``, ``seed``,
``sampling``, ``near_field``), those of the C++ ``PlshOptions``.

``plsh.torch`` (imported on its own, ``import plsh.torch``) adds autograd functions and an
``nn.Module`` for PyTorch; ``import plsh`` does not import torch.

>>> import numpy as np, plsh
>>> q = np.ones((16, 4, 8), np.float32)
>>> plsh.plsh_attention(q, q, q, samples=20, seed=0).shape
(16, 4, 8)
"""

from ._plsh import __version__
from ._plsh import (
    PLSH_DEFAULTS,
    AlibiKvCache,
    CertificateError,
    Grid,
    KeptKeys,
    KvCache,
    MaskError,
    RandomBinning,
    alibi_cache_window,
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
    truncated_alibi_attention,
    truncated_alibi_attention_backward,
    windowed_alibi_attention,
    windowed_alibi_attention_backward,
)

__all__ = [
    "__version__",
    "PLSH_DEFAULTS",
    "AlibiKvCache",
    "CertificateError",
    "Grid",
    "KeptKeys",
    "KvCache",
    "MaskError",
    "RandomBinning",
    "alibi_cache_window",
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
    "truncated_alibi_attention",
    "truncated_alibi_attention_backward",
    "windowed_alibi_attention",
    "windowed_alibi_attention_backward",
]
