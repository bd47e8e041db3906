#ifndef PLSH_DETAIL_CHECK_HPP
#define PLSH_DETAIL_CHECK_HPP

#include <cmath>
#include <stdexcept>
#include <string>

namespace plsh {
namespace detail {

/// Throws `std::invalid_argument("function: message")`.
[[noreturn]] inline void fail(const char* function, const std::string& message) {
  throw std::invalid_argument(std::string(function) + ": " + message);
}

/// Throws `std::invalid_argument("function: message")` unless `condition` holds. Takes the
/// message as a literal so that checks on hot paths build no string when they pass.
inline void require(bool condition, const char* function, const char* message) {
  if (!condition) fail(function, message);
}

/// As above, for a message that names a computed argument (built by the caller).
inline void require(bool condition, const char* function, const std::string& message) {
  if (!condition) fail(function, message);
}

/// A slope must be finite and non-negative (0 means no bias: one block holding everything).
inline void require_slope(double slope, const char* function, const char* name = "slope") {
  if (!(std::isfinite(slope) && slope >= 0)) {
    fail(function, std::string(name) + " must be finite and non-negative (got " +
                       std::to_string(slope) + ")");
  }
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_CHECK_HPP
