#ifndef PLSH_PLSH_HPP
#define PLSH_PLSH_HPP

/// \file plsh.hpp
/// plsh, the module to compute attention with linear biases (ALiBi), exactly or through
/// Positional LSH: options, views, slopes, draws, partitions, the kernels and their backwards,
/// batches, the row log-sum-exp, KV caches. Two more modules, each self-contained:
/// - plsh/analysis.hpp: how far Positional LSH is from ALiBi (mask metrics, matrix-free error
///   norms, attention error);
/// - plsh/reference.hpp: the dense double references the kernels are tested against.
/// plsh/mpi.hpp (target plsh::mpi) adds the sequence-parallel kernels.
///
/// The headers come in layer order; each includes only headers of its own layer or below:
/// limits, options, views -> slopes, draws -> partitions -> scratch -> attention kernels ->
/// batches -> KV caches. (detail/ and attention/detail/ hold the internals: not part of the API.)

// The order is the map of the layers, not the alphabet.
// clang-format off
// Limits, options and strided views.
#include "limits.hpp"
#include "options.hpp"
#include "tensor.hpp"
#include "batched_heads_view.hpp"
#include "row_lse.hpp"

// ALiBi slopes and the draws of Random Binning.
#include "alibi.hpp"
#include "sampler.hpp"

// Block partitions.
#include "partition.hpp"

// The kernels' per-thread scratch: what it keeps, and release_scratch.
#include "scratch.hpp"

// Attention kernels: online softmax, regular, exact, windowed and truncated ALiBi, Positional LSH
// (passes and fused), backward.
#include "attention/online_softmax.hpp"
#include "attention/regular.hpp"
#include "attention/kept_keys.hpp"
#include "attention/alibi_attention.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/backward.hpp"

// Batched entry points.
#include "batch.hpp"

// Incremental decoding: Positional LSH, and exact ALiBi with bounded memory.
#include "kv_cache.hpp"
#include "alibi_kv_cache.hpp"
// clang-format on

#endif  // PLSH_PLSH_HPP
