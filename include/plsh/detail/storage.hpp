#ifndef PLSH_DETAIL_STORAGE_HPP
#define PLSH_DETAIL_STORAGE_HPP

/// \file storage.hpp
/// Storage and compute types of the kernels. A kernel on storage type S reads its inputs and
/// writes its outputs in S and computes in `Compute<S>`: float for the 16-bit types
/// `Eigen::bfloat16` and `Eigen::half`, S itself for float and double. Rows are converted once
/// per tile (compute_rows, OutputRows); for float and double nothing is copied. pack_rows copies
/// rows packed, in the storage or the compute type.
///
/// Tested in tests/test_storage.cpp.

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../tensor.hpp"
#include "scratch.hpp"  // the per-thread workspaces that hold the kernels' scratch
#include "simd.hpp"

namespace plsh {
namespace detail {

template <class Scalar>
struct ComputeTypeOf {
  using type = Scalar;
};
template <>
struct ComputeTypeOf<Eigen::bfloat16> {
  using type = float;
};
template <>
struct ComputeTypeOf<Eigen::half> {
  using type = float;
};

/// The arithmetic type of a kernel whose inputs and outputs are stored as `Storage`.
template <class Storage>
using Compute = typename ComputeTypeOf<std::remove_const_t<Storage>>::type;

/// The storage types the kernels accept: float, double, Eigen::bfloat16, Eigen::half.
template <class Storage>
constexpr bool is_storage_type =
    std::is_same<std::remove_const_t<Storage>, float>::value ||
    std::is_same<std::remove_const_t<Storage>, double>::value ||
    std::is_same<std::remove_const_t<Storage>, Eigen::bfloat16>::value ||
    std::is_same<std::remove_const_t<Storage>, Eigen::half>::value;

/// Scratch of tiles: aligned like Eigen's own storage, so that the vectorised reductions over a
/// tile's rows (sums, maxima) split the same way whatever address the allocation gets, and a
/// result does not depend on the heap's layout or on the thread that computed it.
template <class Scalar>
using AlignedVector = std::vector<Scalar, Eigen::aligned_allocator<Scalar>>;

/// Converts `count` values to the compute type: bfloat16 by a 16-bit shift (exact), half by
/// Eigen's conversion (exact), others by static_cast.
template <class Storage>
void convert_to_compute(const Storage* from, Index count, Compute<Storage>* to) {
  if constexpr (std::is_same<Storage, Eigen::bfloat16>::value) {
    for (Index i = 0; i < count; ++i) {
      const std::uint32_t bits = Eigen::numext::bit_cast<std::uint16_t>(from[i]);
      to[i] = Eigen::numext::bit_cast<float>(bits << 16);
    }
  } else {
    for (Index i = 0; i < count; ++i) to[i] = static_cast<Compute<Storage>>(from[i]);
  }
}

/// Rounds `count` compute-type values to the storage type, to nearest even: bit for bit what
/// `static_cast<Storage>` gives (NaN included), in loops that vectorise where Eigen's scalar
/// conversion does not (a row of output per call of the kernels). bfloat16: the rounding of
/// Eigen's conversion on the float's bits (a NaN becomes the quiet NaN of its sign); half: the
/// processor's conversion with round to nearest even, 16 values at a time in AVX-512 builds
/// (NaNs then by Eigen's conversion, which drops their payload); others by static_cast.
template <class Storage>
void convert_from_compute(const Compute<Storage>* from, Index count, Storage* to) {
  if constexpr (std::is_same<Storage, Eigen::bfloat16>::value) {
    for (Index i = 0; i < count; ++i) {
      const std::uint32_t bits = Eigen::numext::bit_cast<std::uint32_t>(from[i]);
      const auto rounded = static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
      const auto nan = static_cast<std::uint16_t>((bits >> 31) != 0 ? 0xFFC0u : 0x7FC0u);
      to[i] = Eigen::numext::bit_cast<Eigen::bfloat16>(from[i] != from[i] ? nan : rounded);
    }
  } else {
    Index i = 0;
#if defined(PLSH_CONVERT_AVX512_F16C)
    if constexpr (std::is_same<Storage, Eigen::half>::value) {
      for (; i + 16 <= count; i += 16) {
        const __m512 values = _mm512_loadu_ps(from + i);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i),
                            _mm512_cvtps_ph(values, _MM_FROUND_TO_NEAREST_INT));
        // The processor keeps a NaN's payload; Eigen's conversion gives its canonical NaN.
        for (__mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q); nan != 0;
             nan = static_cast<__mmask16>(nan & (nan - 1))) {
          const Index lane = i + __builtin_ctz(nan);
          to[lane] = static_cast<Storage>(from[lane]);
        }
      }
    }
#endif
    for (; i < count; ++i) to[i] = static_cast<Storage>(from[i]);
  }
}

/// Rows `[begin, begin + count)` of `rows` copied into `to`, packed (row stride = cols), as
/// `To`: the storage type itself (a plain copy) or its compute type (convert_to_compute). `to`
/// grows when needed and must outlive the returned map.
template <class To, class Storage>
ConstHeadMap<To> pack_rows(const ConstHeadMap<Storage>& rows, Index begin, Index count,
                           AlignedVector<To>& to) {
  static_assert(std::is_same<To, Storage>::value || std::is_same<To, Compute<Storage>>::value,
                "rows are packed as their storage or their compute type");
  const Index cols = rows.cols();
  const std::size_t needed = static_cast<std::size_t>(count * cols);
  if (to.size() < needed) to.resize(needed);
  for (Index r = 0; r < count; ++r) {
    const Storage* row = rows.data() + (begin + r) * rows.outerStride();
    if constexpr (std::is_same<To, Storage>::value) {
      std::copy(row, row + cols, to.data() + r * cols);
    } else {
      convert_to_compute(row, cols, to.data() + r * cols);
    }
  }
  return ConstHeadMap<To>(to.data(), count, cols, Eigen::OuterStride<>(cols));
}

/// Rows of a head map as the compute type. When `Storage` is the compute type this is the map
/// itself; otherwise the rows are converted into `scratch` (pack_rows), which must outlive the
/// returned map.
template <class Storage>
ConstHeadMap<Compute<Storage>> compute_rows(const ConstHeadMap<Storage>& rows,
                                            AlignedVector<Compute<Storage>>& scratch) {
  if constexpr (std::is_same<Storage, Compute<Storage>>::value) {
    return rows;
  } else {
    return pack_rows(rows, 0, rows.rows(), scratch);
  }
}

/// Rows `[begin, begin + count)` of `rows` as the compute type: compute_rows of those rows.
template <class Storage>
ConstHeadMap<Compute<Storage>> compute_rows(const ConstHeadMap<Storage>& rows, Index begin,
                                            Index count, AlignedVector<Compute<Storage>>& scratch) {
  return compute_rows(ConstHeadMap<Storage>(rows.data() + begin * rows.outerStride(), count,
                                            rows.cols(), Eigen::OuterStride<>(rows.outerStride())),
                      scratch);
}

/// Rows `[begin, begin + count)` of a head map, as a map of the same type.
template <class Map>
Map map_rows(Map map, Index begin, Index count) {
  return Map(map.data() + begin * map.outerStride(), count, map.cols(),
             Eigen::OuterStride<>(map.outerStride()));
}

/// Output rows written in the compute type: `rows()` is the output map itself when `Storage` is
/// the compute type, otherwise a packed scratch in the compute type that `store()` rounds (to
/// nearest even) into the output.
template <class Storage>
class OutputRows {
 public:
  using Scalar = Compute<Storage>;

  /// Binds the output rows `out`; the scratch is reused across calls.
  HeadMap<Scalar> bind(HeadMap<Storage> out) {
    out_ = out.data();
    rows_ = out.rows();
    cols_ = out.cols();
    stride_ = out.outerStride();
    if constexpr (std::is_same<Storage, Scalar>::value) {
      return out;
    } else {
      const std::size_t needed = static_cast<std::size_t>(rows_ * cols_);
      if (scratch_.size() < needed) scratch_.resize(needed);
      return HeadMap<Scalar>(scratch_.data(), rows_, cols_, Eigen::OuterStride<>(cols_));
    }
  }

  /// Binds rows `[begin, begin + count)` of `out`.
  HeadMap<Scalar> bind(HeadMap<Storage> out, Index begin, Index count) {
    return bind(HeadMap<Storage>(out.data() + begin * out.outerStride(), count, out.cols(),
                                 Eigen::OuterStride<>(out.outerStride())));
  }

  /// Writes the bound compute-type rows to the output (nothing to do for float and double).
  void store() {
    if constexpr (!std::is_same<Storage, Scalar>::value) {
      for (Index r = 0; r < rows_; ++r) {
        convert_from_compute(&scratch_[static_cast<std::size_t>(r * cols_)], cols_,
                             out_ + r * stride_);
      }
    }
  }

 private:
  Storage* out_ = nullptr;
  Index rows_ = 0;
  Index cols_ = 0;
  Index stride_ = 0;
  AlignedVector<Scalar> scratch_;
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_STORAGE_HPP
