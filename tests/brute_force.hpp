#ifndef PLSH_TESTS_BRUTE_FORCE_HPP
#define PLSH_TESTS_BRUTE_FORCE_HPP

// Brute-force checks shared by the tests, each written once: the bin test straight from its
// definition, and the count of elements a kernel wrote outside the view it was given.

#include <cmath>
#include <cstddef>
#include <vector>

#include <plsh/sampler.hpp>
#include <plsh/tensor.hpp>

/// Whether positions p and q share a bin of `grid`: \f$\lfloor (p - \text{shift})/\text{pitch}
/// \rfloor\f$ equal, an infinite pitch making one bin. The definition, not the library's test.
inline bool same_bin(const plsh::Grid& grid, plsh::Index p, plsh::Index q) {
  if (std::isinf(grid.pitch)) return true;
  return std::floor((static_cast<double>(p) - grid.shift) / grid.pitch) ==
         std::floor((static_cast<double>(q) - grid.shift) / grid.pitch);
}

/// Number of elements `i` of a storage of `size` elements, outside the elements of `view`
/// (offsets from the storage's start), for which `changed(i)` holds: the padding a kernel must
/// leave untouched.
template <class Scalar, class Changed>
plsh::Index touched_padding(const plsh::HeadsView<Scalar>& view, std::size_t size,
                            Changed&& changed) {
  std::vector<bool> inside(size, false);
  for (plsh::Index t = 0; t < view.tokens; ++t)
    for (plsh::Index h = 0; h < view.heads; ++h)
      for (plsh::Index e = 0; e < view.dim; ++e)
        inside[static_cast<std::size_t>(t * view.token_stride + h * view.head_stride + e)] = true;
  plsh::Index touched = 0;
  for (std::size_t i = 0; i < size; ++i) {
    if (!inside[i] && changed(i)) ++touched;
  }
  return touched;
}

#endif  // PLSH_TESTS_BRUTE_FORCE_HPP
