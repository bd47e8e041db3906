#ifndef PLSH_SCRATCH_HPP
#define PLSH_SCRATCH_HPP

/// \file scratch.hpp
/// The memory the kernels keep between calls, and how to free it.
///
/// Every thread that runs a kernel keeps one workspace per kind of work and scalar type (a tile of
/// scores, the converted rows of a 16-bit tile, the backward's tile, the fused kernel's counts and
/// packed keys, the pass kernel's block buffers), so that a call allocates nothing once the thread
/// has seen a call of the same shape. A workspace keeps the largest size its thread has needed:
/// O(tile) for the tiled kernels (a 64-row tile of the query rows and scores against 128 keys); the
/// fused kernel's packed keys and values, up to 2 * kFusedSpanKeys rows of a span (about
/// 2 * 8192 * d scalars); the pass kernel's largest block; in total a few megabytes per thread
/// for head dimensions of a few hundred, whatever the sequence length, except the pass kernel,
/// whose block buffers hold the widest block seen (rows of a flat head's block, `1/m` and more).
/// Threads: the calling thread and those of the OpenMP team that ran the kernel.
///
/// release_scratch frees them, for instance after a long call with a flat head or before a long
/// phase without attention. The next call allocates again and computes the same results bit for
/// bit. A workspace is never shared between threads; a kernel that calls back into plsh on the
/// same thread while its workspace is in use (a regular kernel passed to plsh_attention calling
/// plsh_attention with Kernel::Passes) gets std::logic_error.
///
/// Tested in tests/test_scratch.cpp.

#include <cstddef>

#include "detail/scratch.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace plsh {

/// Frees the workspaces of the calling thread and, compiled with OpenMP and called outside a
/// parallel region, those of the threads of an OpenMP team of the default size (each frees its
/// own in a parallel region). A workspace in use by a call on the same thread (from within a
/// regular kernel) is kept. Threads of the caller's own (std::thread) call it themselves.
inline void release_scratch() {
#if defined(_OPENMP)
  if (!omp_in_parallel()) {
#pragma omp parallel
    detail::release_thread_scratch();
  }
#endif
  detail::release_thread_scratch();
}

/// The number of workspaces the calling thread keeps (0 after release_scratch, until its next
/// kernel call).
inline std::size_t scratch_workspaces() { return detail::thread_scratch_workspaces(); }

}  // namespace plsh

#endif  // PLSH_SCRATCH_HPP
