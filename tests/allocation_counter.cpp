// The global operator new and delete of plsh_counted_tests, counting every allocation
// (allocation_counter.hpp): one definition per executable, so they live in this source file.

#include "allocation_counter.hpp"

#include <cstdlib>
#include <new>

// GCC warns about free() on memory from operator new once both are inlined; here operator new is
// malloc.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {

void* counted_allocation(std::size_t size) noexcept {
  plsh_test::allocations.fetch_add(1, std::memory_order_relaxed);
  std::size_t largest = plsh_test::largest_allocation.load(std::memory_order_relaxed);
  while (size > largest && !plsh_test::largest_allocation.compare_exchange_weak(
                               largest, size, std::memory_order_relaxed)) {
  }
  return std::malloc(size == 0 ? 1 : size);
}

void* counted_allocation_or_throw(std::size_t size) {
  if (void* pointer = counted_allocation(size)) return pointer;
  throw std::bad_alloc();
}

}  // namespace

// Every form that pairs with the deletes below, so that no memory crosses allocators.
void* operator new(std::size_t size) { return counted_allocation_or_throw(size); }
void* operator new[](std::size_t size) { return counted_allocation_or_throw(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  return counted_allocation(size);
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return counted_allocation(size);
}
void operator delete(void* pointer) noexcept { std::free(pointer); }
void operator delete[](void* pointer) noexcept { std::free(pointer); }
void operator delete(void* pointer, std::size_t) noexcept { std::free(pointer); }
void operator delete[](void* pointer, std::size_t) noexcept { std::free(pointer); }
void operator delete(void* pointer, const std::nothrow_t&) noexcept { std::free(pointer); }
void operator delete[](void* pointer, const std::nothrow_t&) noexcept { std::free(pointer); }
