#ifndef PLSH_SCRATCH_HPP
#define PLSH_SCRATCH_HPP

/// \file scratch.hpp
/// The memory the kernels keep between calls, and how to free it.
///
/// Every thread that runs a kernel keeps one workspace per kind of work and scalar type (the tiled
/// kernels' tile of scores and online softmax, the rows of a 16-bit tile converted to float, the
/// backward's tile, the fused kernel's tile and packed span keys, the pass kernel's block
/// buffers), so that a call allocates nothing once the thread has seen a call of the same shape.
/// A workspace keeps the largest size its thread has needed: a fixed tile (64 query rows against
/// 128 keys) for exact, truncated and windowed ALiBi and the backward; at most 8192 key and value
/// rows for the fused kernel's span keys; and, for the fused kernel's tile and the pass kernel's
/// blocks, the union of a tile's blocks or the widest block, about 1/m positions for a head of
/// slope m and the whole sequence at slope 0. Threads: the calling thread and those of the OpenMP
/// team that ran the kernel. docs/performance.md lists them.
///
/// release_scratch frees them, for instance after a long call with a flat head or before a long
/// phase without attention. The next call allocates again and computes the same results bit for
/// bit. A workspace is never shared between threads; a kernel that calls back into plsh on the
/// same thread while its workspace is in use (a regular kernel passed to plsh_attention calling
/// plsh_attention with Kernel::Passes) gets std::logic_error.
///
/// Cost: release_scratch opens one parallel region, in which each thread walks its few
/// workspaces; scratch_workspaces walks the calling thread's.
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
