// touch_pages: maps every page of the benchmarks' tensors before their timed calls.

#ifndef PLSH_BENCH_TOUCH_PAGES_HPP
#define PLSH_BENCH_TOUCH_PAGES_HPP

#include <benchmark/benchmark.h>

#include <cstddef>
#include <type_traits>

namespace plsh_bench {

/// Reads one element of every page of each tensor. On the virtual machines measured, the first
/// access to each page after the process returns memory to the system (the setup's temporaries,
/// the entry counts, the reference of relative_error) costs about 2 microseconds: the first
/// fused call at n = 2^16 took 590-950 ms against 345 ms for the next ones. The timed calls start
/// with every page of their inputs and outputs mapped.
template <class... Vectors>
void touch_pages(const Vectors&... tensors) {
  float sum = 0;
  const auto touch = [&sum](const auto& tensor) {
    using Element = typename std::decay_t<decltype(tensor)>::value_type;
    constexpr std::size_t kStep = 4096 / sizeof(Element);
    for (std::size_t i = 0; i < tensor.size(); i += kStep) sum += static_cast<float>(tensor[i]);
  };
  (touch(tensors), ...);
  benchmark::DoNotOptimize(sum);
}

}  // namespace plsh_bench

#endif  // PLSH_BENCH_TOUCH_PAGES_HPP
