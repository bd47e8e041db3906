#ifndef PLSH_ANALYSIS_HPP
#define PLSH_ANALYSIS_HPP

/// \file analysis.hpp
/// plsh's analysis module: how far Positional LSH is from ALiBi, to choose s and the sampling, or
/// to study a model; not needed to compute attention (plsh/plsh.hpp). Self-contained.
/// - metrics.hpp: MaskError, mask_error, the dense error of a mean mask against the factor matrix;
/// - error_norms.hpp: the same norms matrix-free (max norm exactly, spectral norm by Lanczos);
/// - attention_error.hpp: norms of the difference of the attention matrices of Positional LSH and
///   exact ALiBi, dense, row by row, or matrix-free.
/// error_norms.hpp and attention_error.hpp use Spectra's Lanczos solver only when its headers are
/// found (and PLSH_NO_SPECTRA is not defined): plsh builds without Spectra.

// clang-format off
#include "metrics.hpp"
#include "error_norms.hpp"
#include "attention_error.hpp"
// clang-format on

#endif  // PLSH_ANALYSIS_HPP
