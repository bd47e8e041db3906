#ifndef PLSH_DETAIL_CHECK_HPP
#define PLSH_DETAIL_CHECK_HPP

#include <cmath>
#include <stdexcept>
#include <string>

namespace plsh {
namespace detail {

/// Throws `std::invalid_argument("function: message")` unless `condition` holds.
inline void require(bool condition, const char* function, const std::string& message) {
  if (!condition) throw std::invalid_argument(std::string(function) + ": " + message);
}

/// A slope must be finite and non-negative (0 means no bias: one block holding everything).
inline void require_slope(double slope, const char* function, const std::string& name = "slope") {
  require(std::isfinite(slope) && slope >= 0, function,
          name + " must be finite and non-negative (got " + std::to_string(slope) + ")");
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_CHECK_HPP
