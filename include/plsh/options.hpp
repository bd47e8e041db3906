#ifndef PLSH_OPTIONS_HPP
#define PLSH_OPTIONS_HPP

/// \file options.hpp
/// Options shared by the attention kernels (plsh_attention, exact and windowed ALiBi, the backward,
/// KvCache). Kept below the attention headers so that argument checks can include it.

#include <Eigen/Core>
#include <cstdint>

#include "limits.hpp"

namespace plsh {

using Index = Eigen::Index;

/// Options of every attention kernel.
struct AttentionOptions {
  bool causal = true;  ///< keep only keys at positions <= the query's position
  double scale = 0;    ///< logit scale; 0 means 1/sqrt(head dim)
  /// Absolute position of the first query row; `query_position + q.tokens <= kMaxPosition`.
  Index query_position = 0;
  /// Absolute position of the first key row; `key_position + k.tokens <= kMaxPosition`.
  Index key_position = 0;
};

/// How plsh_attention evaluates the Positional LSH estimator (both compute the same function).
enum class Kernel {
  Fused,   ///< each score once, weighted by the number of draws that share the block
  Passes,  ///< one regular attention pass per draw and block, merged by log-sum-exp
};

/// How the s partitions of a head are drawn (kernel_grids). Every single draw has the Random
/// Binning law (pitch Gamma(2, 1/m), shift uniform on [0, pitch)), so \f$E[\hat K] = K\f$ either
/// way; they differ in how the s draws depend on one another.
enum class Sampling {
  /// Independent draws: head h, draw t is RandomBinning(slopes[h], head_seed(seed, h))(t).
  Independent,
  /// The s draws of a head jointly, as a Latin hypercube over the three uniforms of a draw:
  /// each uniform takes exactly one value in each of the s strata [k/s, (k+1)/s)
  /// (latin_hypercube_grids). Lower mask and attention errors at equal s.
  LatinHypercube,
};

/// Options of plsh_attention.
///
/// The defaults, `PlshOptions{}`: causal, s = 100 draws as a Latin hypercube, the exact factor
/// where it is at least 0.05 (near_field), seed 0, Kernel::Fused. They are the configuration
/// whose trained models came closest to ALiBi's in docs/training/study.md, at about 1.5 times the
/// training step time of paper(). Both kernels accept every option and compute the same function.
struct PlshOptions : AttentionOptions {
  Index samples = 100;     ///< number of random partitions s, 1 to kMaxSamples
  std::uint64_t seed = 0;  ///< head h draws with head_seed(seed, h)
  Kernel kernel = Kernel::Fused;
  Sampling sampling = Sampling::LatinHypercube;  ///< how the s partitions of a head are drawn
  /// The near-field estimator (attention/near_field.hpp): head h takes the exact factor
  /// \f$e^{-m_h|p_i - p_j|}\f$ where it is at least `near_field`, the mean of its block masks
  /// beyond; same mean, no variance near the diagonal. In [0, 1]; 0: the block masks everywhere.
  /// Every kernel honours it: Fused and Passes (a regular kernel of the caller's included), the
  /// backward, the references, KvCache and the MPI kernels.
  double near_field = 0.05;

  /// The paper's estimator: s = 20 independent draws, block masks everywhere (samples = 20,
  /// sampling = Sampling::Independent, near_field = 0); the other fields at their defaults.
  static PlshOptions paper() {
    PlshOptions options;
    options.samples = 20;
    options.sampling = Sampling::Independent;
    options.near_field = 0;
    return options;
  }
};

}  // namespace plsh

#endif  // PLSH_OPTIONS_HPP
