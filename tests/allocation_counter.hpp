// Replaces the global operator new and delete of a test executable so that a test can count
// heap allocations: `plsh_test::allocations` is incremented by every allocation, and
// `plsh_test::largest_allocation` holds the largest size asked. Include it in exactly one source
// file of an executable (each tests/test_*.cpp is its own executable): the replacement functions
// are definitions.

#ifndef PLSH_TESTS_ALLOCATION_COUNTER_HPP
#define PLSH_TESTS_ALLOCATION_COUNTER_HPP

#include <atomic>
#include <cstdlib>
#include <new>

// GCC warns about free() on memory from operator new once both are inlined; here operator new is
// malloc.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace plsh_test {

/// Heap allocations made so far by the executable.
inline std::atomic<long> allocations{0};

/// The largest size in bytes asked of one allocation since a test last set it to 0.
inline std::atomic<std::size_t> largest_allocation{0};

inline void* counted_allocation(std::size_t size) noexcept {
  allocations.fetch_add(1, std::memory_order_relaxed);
  std::size_t largest = largest_allocation.load(std::memory_order_relaxed);
  while (size > largest &&
         !largest_allocation.compare_exchange_weak(largest, size, std::memory_order_relaxed)) {
  }
  return std::malloc(size == 0 ? 1 : size);
}

inline void* counted_allocation_or_throw(std::size_t size) {
  if (void* pointer = counted_allocation(size)) return pointer;
  throw std::bad_alloc();
}

}  // namespace plsh_test

// Every form that pairs with the deletes below, so that no memory crosses allocators.
void* operator new(std::size_t size) { return plsh_test::counted_allocation_or_throw(size); }
void* operator new[](std::size_t size) { return plsh_test::counted_allocation_or_throw(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  return plsh_test::counted_allocation(size);
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return plsh_test::counted_allocation(size);
}
void operator delete(void* pointer) noexcept { std::free(pointer); }
void operator delete[](void* pointer) noexcept { std::free(pointer); }
void operator delete(void* pointer, std::size_t) noexcept { std::free(pointer); }
void operator delete[](void* pointer, std::size_t) noexcept { std::free(pointer); }
void operator delete(void* pointer, const std::nothrow_t&) noexcept { std::free(pointer); }
void operator delete[](void* pointer, const std::nothrow_t&) noexcept { std::free(pointer); }

#endif  // PLSH_TESTS_ALLOCATION_COUNTER_HPP
