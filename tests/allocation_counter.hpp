// Heap allocations, counted: tests/allocation_counter.cpp replaces the global operator new and
// delete of the executable it is linked into (plsh_counted_tests, tests/CMakeLists.txt), so that
// `plsh_test::allocations` is incremented by every allocation and `plsh_test::largest_allocation`
// holds the largest size asked. Only the test files of that executable include this header.

#ifndef PLSH_TESTS_ALLOCATION_COUNTER_HPP
#define PLSH_TESTS_ALLOCATION_COUNTER_HPP

#include <atomic>
#include <cstddef>

namespace plsh_test {

/// Heap allocations made so far by the executable.
inline std::atomic<long> allocations{0};

/// The largest size in bytes asked of one allocation since a test last set it to 0.
inline std::atomic<std::size_t> largest_allocation{0};

}  // namespace plsh_test

#endif  // PLSH_TESTS_ALLOCATION_COUNTER_HPP
