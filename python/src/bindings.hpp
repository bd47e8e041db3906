// The families of bindings of the module plsh._plsh, one source file each; module.cpp calls them
// in this order.

#ifndef PLSH_PYTHON_BINDINGS_HPP
#define PLSH_PYTHON_BINDINGS_HPP

#include <pybind11/pybind11.h>

namespace plsh_python {

// partitions.cpp: alibi_slopes, Grid, RandomBinning, head_seed, draw_head_grids, kernel_grids,
// MaskError and mask_error.
void bind_partitions(pybind11::module_& module);

// attention.cpp: the kernels exact_alibi_attention, windowed_alibi_attention, plsh_attention and
// fixed_block_attention and their backward kernels (exact_alibi_attention_backward, ...).
void bind_attention(pybind11::module_& module);

// kv_cache.cpp: the class KvCache.
void bind_kv_cache(pybind11::module_& module);

// alibi_kv_cache.cpp: the class AlibiKvCache, the function alibi_cache_window and the exception
// CertificateError.
void bind_alibi_kv_cache(pybind11::module_& module);

}  // namespace plsh_python

#endif  // PLSH_PYTHON_BINDINGS_HPP
