#ifndef PLSH_PLSH_HPP
#define PLSH_PLSH_HPP

/// \file plsh.hpp
/// Umbrella header of plsh: attention with linear biases (ALiBi) through Positional LSH.
/// error_norms.hpp and attention_error.hpp include Spectra's Lanczos solver only when its headers
/// are found (and PLSH_NO_SPECTRA is not defined): plsh builds without Spectra.
///
/// The headers come in layer order; each includes only headers of its own layer or below:
/// limits, options, views -> slopes, draws -> partitions, mask metrics -> scratch -> attention
/// kernels -> batches -> KV caches -> attention error. (detail/ holds the internals of every
/// layer.)

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

// Block partitions and the error of their mean mask.
#include "partition.hpp"
#include "metrics.hpp"
#include "error_norms.hpp"

// The kernels' per-thread scratch: what it keeps, and release_scratch.
#include "scratch.hpp"

// Attention kernels: online softmax, regular, the certified window, exact, windowed and truncated
// ALiBi, Positional LSH (passes and fused), backward, and the dense references they are tested
// against.
#include "attention/options.hpp"
#include "attention/online_softmax.hpp"
#include "attention/regular.hpp"
#include "attention/windowed.hpp"
#include "attention/kept_keys.hpp"
#include "attention/alibi_attention.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/backward.hpp"
#include "attention/reference.hpp"

// Batched entry points.
#include "batch.hpp"

// Incremental decoding: Positional LSH, and exact ALiBi with bounded memory.
#include "kv_cache.hpp"
#include "alibi_kv_cache.hpp"

// Error of Positional LSH attention against exact ALiBi.
#include "attention_error.hpp"
// clang-format on

#endif  // PLSH_PLSH_HPP
