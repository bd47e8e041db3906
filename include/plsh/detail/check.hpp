#ifndef PLSH_DETAIL_CHECK_HPP
#define PLSH_DETAIL_CHECK_HPP

/// \file check.hpp
/// Argument checks of single values (a slope, a number of draws against limits.hpp); the checks
/// of views and options are in validate.hpp. A check that passes builds no string and allocates
/// nothing: messages are literals, or pieces joined by `fail` only when the check fails, or built
/// by a callable that runs only then.

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "../limits.hpp"

namespace plsh {
namespace detail {

/// Throws `std::invalid_argument("function: message")`.
[[noreturn]] inline void fail(const char* function, const std::string& message) {
  throw std::invalid_argument(std::string(function) + ": " + message);
}

/// Throws `std::invalid_argument("function: " + name + what)`, e.g. ("q", ".dim must be ...").
[[noreturn]] inline void fail(const char* function, const char* name, const char* what) {
  fail(function, std::string(name) + what);
}

/// Throws `std::invalid_argument("function: message")` unless `condition` holds.
inline void require(bool condition, const char* function, const char* message) {
  if (!condition) fail(function, message);
}

/// As above, with the message `name + what` joined only on failure.
inline void require(bool condition, const char* function, const char* name, const char* what) {
  if (!condition) fail(function, name, what);
}

/// As above, with a message that names computed values: `message()` returns it and runs only
/// when the check fails.
template <class Message, class = std::enable_if_t<std::is_convertible<
                             std::invoke_result_t<Message&>, std::string>::value>>
void require(bool condition, const char* function, Message&& message) {
  if (!condition) fail(function, message());
}

/// A slope must be finite and non-negative (0 means no bias: one block holding everything).
/// `index >= 0` names element `name[index]` of a list.
inline void require_slope(double slope, const char* function, const char* name = "slope",
                          std::int64_t index = -1) {
  if (std::isfinite(slope) && slope >= 0) return;
  fail(function, std::string(name) + (index >= 0 ? "[" + std::to_string(index) + "]" : "") +
                     " must be finite and non-negative (got " + std::to_string(slope) + ")");
}

/// A tolerance (a weight or a factor below which keys are dropped) must lie in [0, 1]; NaN does
/// not.
inline void require_tolerance(double tolerance, const char* function,
                              const char* name = "tolerance") {
  require(tolerance >= 0 && tolerance <= 1, function, name, " must lie in [0, 1]");
}

/// A number of draws per head of the multi-head kernels: 1 to kMaxSamples.
inline void require_samples(Index samples, const char* function, const char* name = "samples") {
  require(samples >= 1 && samples <= kMaxSamples, function, [&] {
    return std::string(name) + " must lie in [1, kMaxSamples = " + std::to_string(kMaxSamples) +
           "] (got " + std::to_string(samples) + ")";
  });
}

/// `a + b`, or false when it overflows `std::int64_t`.
inline bool checked_add(std::int64_t a, std::int64_t b, std::int64_t& sum) {
  if ((b > 0 && a > std::numeric_limits<std::int64_t>::max() - b) ||
      (b < 0 && a < std::numeric_limits<std::int64_t>::min() - b)) {
    return false;
  }
  sum = a + b;
  return true;
}

/// `a * b` for non-negative `a` and `b`, or false when it overflows `std::int64_t`.
inline bool checked_multiply(std::int64_t a, std::int64_t b, std::int64_t& product) {
  if (a < 0 || b < 0 || (b != 0 && a > std::numeric_limits<std::int64_t>::max() / b)) return false;
  product = a * b;
  return true;
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_CHECK_HPP
