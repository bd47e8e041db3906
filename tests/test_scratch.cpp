// Tests of the kernels' per-thread scratch (scratch.hpp, detail/scratch.hpp): a second call of a
// shape allocates as often with more tiles or jobs (operator new, nothing per tile or block: the
// windowed forward, the pass kernel); a regular kernel that calls back into the pass kernel gets
// std::logic_error and leaves the library usable; release_scratch frees the workspaces, on the
// OpenMP team's threads too, and the next call allocates them again with the same results.

#include <catch2/catch.hpp>

#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/attention/regular.hpp>
#include <plsh/batch.hpp>
#include <plsh/scratch.hpp>

#include "allocation_counter.hpp"
#include "attention_fixture.hpp"
#include "kernel_instances.hpp"
#include "thread_count.hpp"

namespace test_scratch {

namespace {

using plsh::BatchedHeadsView;
using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Problem;
using plsh_test::Shape;

/// Heap allocations (operator new) made by `call`.
template <class Call>
long allocations_of(Call&& call) {
  const long before = plsh_test::allocations.load();
  call();
  return plsh_test::allocations.load() - before;
}

/// The allocations of the second of two calls of `call`.
template <class Call>
long second_call_allocations(Call&& call) {
  call();
  return allocations_of(call);
}

/// `batch` elements of `tokens` rows, packed one after the other, with random entries.
struct BatchBuffer {
  Buffer<double> buffer;
  Index batch;
  Index tokens;

  BatchBuffer(Index batch_size, Index token_count, Index heads, Index dim, std::uint64_t seed)
      : buffer(batch_size * token_count, heads, dim), batch(batch_size), tokens(token_count) {
    buffer.fill_random(seed);
  }
  BatchedHeadsView<double> view() {
    const plsh::HeadsView<double> first{buffer.view.data, tokens, buffer.view.heads,
                                        buffer.view.dim};
    return BatchedHeadsView<double>(batch, first, tokens * first.heads * first.dim);
  }
};

/// One head of a map as a HeadsView of one head.
plsh::HeadsView<const double> as_view(const plsh::ConstHeadMap<double>& map) {
  return plsh::HeadsView<const double>{map.data(), map.rows(),        1,
                                       map.cols(), map.outerStride(), map.cols()};
}

plsh::PlshOptions pass_options() {
  plsh::PlshOptions options;
  options.samples = 6;
  options.seed = 3;
  options.near_field = 0;
  options.kernel = plsh::Kernel::Passes;
  return options;
}

}  // namespace

TEST_CASE("a second windowed forward allocates nothing per tile", "[scratch][allocations]") {
  // 512 rows of 8 tiles, on 1 and on 8 query heads that share one key/value head: eight times the
  // tiles, the same key norm bounds. The call's own allocations (the norm bounds) are the same;
  // a tile's certificate rows come from the thread's workspace.
  const plsh_test::ThreadCount threads(1);
  long per_heads[2] = {0, 0};
  int i = 0;
  for (const Index heads : {Index{1}, Index{8}}) {
    Problem<double> problem(Shape{512, 512, heads, 1, 16, 16}, 11);
    const std::vector<double> slopes(static_cast<std::size_t>(heads), 1.0 / 16);
    per_heads[i++] = second_call_allocations([&] {
      plsh::windowed_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                             problem.out.view, slopes, 1e-6);
    });
  }
  INFO("1 head: " << per_heads[0] << " allocations, 8 heads: " << per_heads[1]);
  CHECK(per_heads[1] == per_heads[0]);
}

TEST_CASE("a second pass kernel call allocates no block buffers per job",
          "[scratch][allocations]") {
  // Batches of 1 and 4 elements: four times the (element, head) jobs, the same draws. A block's
  // output and lse come from the thread's workspace. (The head's merged output and lse, O(n), are
  // the job's own, from Eigen's allocator, which the counter does not see.)
  const plsh_test::ThreadCount threads(1);
  const std::vector<double> slopes = {0.25, 1.0 / 16};
  long per_batch[2] = {0, 0};
  int i = 0;
  for (const Index batch : {Index{1}, Index{4}}) {
    BatchBuffer q(batch, 200, 2, 8, 1), k(batch, 200, 2, 8, 2), v(batch, 200, 2, 8, 3);
    BatchBuffer out(batch, 200, 2, 8, 4);
    per_batch[i++] = second_call_allocations([&] {
      plsh::plsh_attention<double>(q.view(), k.view(), v.view(), out.view(), slopes,
                                   pass_options());
    });
  }
  INFO("batch 1: " << per_batch[0] << " allocations, batch 4: " << per_batch[1]);
  CHECK(per_batch[1] == per_batch[0]);
}

TEST_CASE("a regular kernel that calls the pass kernel back gets std::logic_error",
          "[scratch][nested]") {
  // 300 rows of 2 heads: enough work for a parallel region on 2 threads.
  Problem<double> problem(Shape{300, 300, 2, 1, 8, 8}, 5);
  const std::vector<double> slopes = {0.25, 1.0 / 16};
  const plsh::PlshOptions options = pass_options();
  Buffer<double> expected = problem.output();
  plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                               slopes, options);
  // The block's own attention, then the same block again through the fixed-blocks baseline (the
  // pass kernel) or through the fused kernel.
  const auto calling_back = [](plsh::Kernel inner) {
    return [inner](const plsh::ConstHeadMap<double>& q, const plsh::ConstHeadMap<double>& k,
                   const plsh::ConstHeadMap<double>& v, const plsh::AttentionOptions& block_options,
                   plsh::HeadMap<double> out, plsh::LseMap<double> lse) {
      plsh::regular_attention<double>(q, k, v, block_options, out, lse);
      std::vector<double> inner_out(static_cast<std::size_t>(q.rows() * v.cols()));
      const plsh::HeadsView<double> inner_view{inner_out.data(), q.rows(), 1, v.cols()};
      if (inner == plsh::Kernel::Passes) {
        plsh::fixed_block_attention<double>(as_view(q), as_view(k), as_view(v), inner_view, 4,
                                            block_options);
      } else {
        plsh::PlshOptions fused;
        static_cast<plsh::AttentionOptions&>(fused) = block_options;
        fused.samples = 3;
        plsh::plsh_attention<double>(as_view(q), as_view(k), as_view(v), inner_view, {0.5}, fused);
      }
    };
  };
  for (const int thread_count : {1, 2}) {
    const plsh_test::ThreadCount threads(thread_count);
    INFO(thread_count << " threads");
    Buffer<double> out = problem.output();
    REQUIRE_THROWS_AS(
        plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), out.view,
                                     slopes, options, calling_back(plsh::Kernel::Passes)),
        std::logic_error);
    REQUIRE_THROWS_WITH(
        plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), out.view,
                                     slopes, options, calling_back(plsh::Kernel::Passes)),
        Catch::Contains("a regular kernel called back into plsh") &&
            Catch::Contains("another thread"));
    // The library is usable afterwards, with the same results.
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), out.view, slopes,
                                 options);
    CHECK(out.storage == expected.storage);
    // The fused kernel's workspaces are others than the pass kernel's: calling it back is fine.
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), out.view, slopes,
                                 options, calling_back(plsh::Kernel::Fused));
    CHECK(out.storage == expected.storage);
  }
}

TEST_CASE("release_scratch frees the workspaces and the results stay the same",
          "[scratch][release]") {
  Problem<double> problem(Shape{300, 300, 4, 2, 16, 16}, 9);
  const std::vector<double> slopes = {0.5, 0.25, 1.0 / 16, 1.0 / 64};
  plsh::PlshOptions fused;
  fused.samples = 8;
  const auto run_all = [&](Buffer<double>& windowed, Buffer<double>& passes,
                           Buffer<double>& fused_out) {
    plsh::windowed_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                           windowed.view, slopes, 1e-6);
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), passes.view,
                                 slopes, pass_options());
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), fused_out.view,
                                 slopes, fused);
  };
  {
    const plsh_test::ThreadCount threads(1);
    Buffer<double> windowed = problem.output(), passes = problem.output();
    Buffer<double> fused_out = problem.output();
    run_all(windowed, passes, fused_out);
    const long warm = allocations_of([&] { run_all(windowed, passes, fused_out); });
    CHECK(plsh::scratch_workspaces() > 0);
    plsh::release_scratch();
    CHECK(plsh::scratch_workspaces() == 0);
    Buffer<double> windowed_after = problem.output(), passes_after = problem.output();
    Buffer<double> fused_after = problem.output();
    const long after_release =
        allocations_of([&] { run_all(windowed_after, passes_after, fused_after); });
    INFO("a warm call: " << warm << " allocations, after release_scratch: " << after_release);
    CHECK(after_release > warm);  // the workspaces again
    CHECK(plsh::scratch_workspaces() > 0);
    CHECK(std::memcmp(windowed.storage.data(), windowed_after.storage.data(),
                      windowed.storage.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(passes.storage.data(), passes_after.storage.data(),
                      passes.storage.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(fused_out.storage.data(), fused_after.storage.data(),
                      fused_out.storage.size() * sizeof(double)) == 0);
  }
#if defined(_OPENMP)
  {
    // The team's threads free their own: none keeps a workspace after release_scratch.
    const plsh_test::ThreadCount threads(2);
    Problem<double> large(Shape{2048, 2048, 4, 2, 16, 16}, 10);  // enough work for the team
    plsh::windowed_alibi_attention<double>(large.q.in(), large.k.in(), large.v.in(), large.out.view,
                                           slopes, 1e-6);
    std::vector<std::size_t> held(2, 0);
#pragma omp parallel num_threads(2)
    held[static_cast<std::size_t>(omp_get_thread_num())] = plsh::scratch_workspaces();
    INFO("workspaces per thread before: " << held[0] << ", " << held[1]);
    CHECK(held[0] + held[1] > 0);
    plsh::release_scratch();
#pragma omp parallel num_threads(2)
    held[static_cast<std::size_t>(omp_get_thread_num())] = plsh::scratch_workspaces();
    CHECK(held[0] == 0);
    CHECK(held[1] == 0);
  }
#endif
}

}  // namespace test_scratch
