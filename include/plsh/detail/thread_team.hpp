#ifndef PLSH_DETAIL_THREAD_TEAM_HPP
#define PLSH_DETAIL_THREAD_TEAM_HPP

// ThreadTeam: helper threads for parallel steps of a few microseconds (one decoding step).
//
// An OpenMP parallel region ends in barriers whose last thread makes a futex system call
// (libgomp) even when the other threads are spinning, which costs a noticeable part of a
// decoding step of some microseconds. Here the calling thread hands a step to helpers that spin
// on a counter and report through one, so a step on warm helpers makes no system call. A helper
// that has waited kSpin without work sleeps on a condition variable (the next step then wakes it
// with one call), as libgomp's threads do after their spin count.
//
// Tested in tests/test_thread_team.cpp (every part once, on distinct threads; exceptions; a busy
// team; sleeping helpers; a forked child) and through KvCache's tests at 1, 2 and 3 threads.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <immintrin.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace plsh {
namespace detail {

/// A spin-wait hint to the processor.
inline void spin_pause() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
  _mm_pause();
#endif
}

/// Helper threads that run the parts of short steps: `run(parts, body)` calls `body(part)` for
/// part in [0, parts), part 0 on the calling thread and part i on helper i, and returns once
/// every part is done. One process-wide team (`shared()`), used by one caller at a time: `run`
/// returns false without running anything when another thread is inside it, or in the child of a
/// fork (whose copy of the team has no threads); the caller then takes another way.
class ThreadTeam {
 public:
  /// How long a helper spins for the next step before it sleeps.
  static constexpr std::chrono::microseconds kSpin{200};
  /// How many times the calling thread polls a helper before it yields its core between polls.
  static constexpr int kSpinsBeforeYield = 1 << 12;

  /// The team, created on first use and never destroyed: its helpers wait until the process
  /// ends, so no static destructor can run while one of them still uses the team, and a forked
  /// child (whose copy has no threads) never joins threads it does not have.
  static ThreadTeam& shared() {
    static ThreadTeam* const team = new ThreadTeam;
    return *team;
  }

  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

  /// Runs `body(part)` for every part in [0, parts) (parts >= 1) and returns true, or returns
  /// false without running any when the team is in use or cannot start its threads. The first
  /// exception of a part (in part order) reaches the caller after every part has finished.
  template <class Body>
  bool run(int parts, Body&& body) {
    using Target = std::remove_reference_t<Body>;
    std::unique_lock<std::mutex> in_use(use_, std::try_to_lock);
    if (!in_use.owns_lock() || forked().load(std::memory_order_relaxed)) return false;
    if (!grow(parts - 1)) return false;
    step_.body = const_cast<void*>(static_cast<const void*>(&body));
    step_.invoke = [](void* target, int part) { (*static_cast<Target*>(target))(part); };
    step_.parts = parts;
    const std::uint64_t generation = step_.generation.load(std::memory_order_relaxed) + 1;
    step_.generation.store(generation, std::memory_order_release);
    // Helpers seen asleep are woken before part 0; the check after it (below) is the one that
    // cannot miss a helper that falls asleep meanwhile.
    if (sleepers_.load(std::memory_order_relaxed) > 0) wake_sleepers();
    std::exception_ptr failure;
    try {
      body(0);
    } catch (...) {
      failure = std::current_exception();
    }
    // Only now the fence that orders the generation before the read of sleepers_ (against a
    // helper's increment of sleepers_ before its last read of the generation): a fence right
    // after the store would hold this thread until the store reached the helpers' core, a round
    // trip of the step's cache line, before its own part.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_sleepers();
    // Every helper acknowledges every step, so none can still be reading this step's body when
    // the next one is written.
    for (auto& helper : helpers_) {
      // Yielding after a while lets a helper that shares a core with this thread finish.
      for (int spins = 0; helper->done.load(std::memory_order_acquire) != generation; ++spins) {
        if (spins < kSpinsBeforeYield) {
          spin_pause();
        } else {
          std::this_thread::yield();
        }
      }
      if (helper->failure) {
        if (!failure) failure = helper->failure;
        helper->failure = nullptr;
      }
    }
    if (failure) std::rethrow_exception(failure);
    return true;
  }

 private:
  // One cache line, written by its helper at the end of a step and read by the calling thread:
  // done and failure reach it together.
  struct alignas(64) Helper {
    std::atomic<std::uint64_t> done{0};
    std::exception_ptr failure;
    std::thread thread;
  };

  ThreadTeam() {
#if defined(__unix__) || defined(__APPLE__)
    pthread_atfork(nullptr, nullptr, [] { forked().store(true, std::memory_order_relaxed); });
#endif
  }

  static std::atomic<bool>& forked() {
    static std::atomic<bool> flag{false};
    return flag;
  }

  void wake_sleepers() {
    std::lock_guard<std::mutex> lock(sleep_);
    wake_.notify_all();
  }

  /// At least `count` helpers; false when a thread cannot be started.
  bool grow(int count) {
    while (static_cast<int>(helpers_.size()) < count) {
      auto helper = std::make_unique<Helper>();
      // A new helper starts at the current step, which it does not run.
      helper->done.store(step_.generation.load(std::memory_order_relaxed),
                         std::memory_order_relaxed);
      const int index = static_cast<int>(helpers_.size());
      Helper* self = helper.get();
      try {
        helper->thread = std::thread([this, self, index] { work(*self, index); });
      } catch (const std::system_error&) {
        return false;
      }
      helpers_.push_back(std::move(helper));
    }
    return true;
  }

  void work(Helper& self, int index) {
    std::uint64_t seen = self.done.load(std::memory_order_relaxed);
    for (;;) {
      const auto spin_end = std::chrono::steady_clock::now() + kSpin;
      std::uint64_t generation = step_.generation.load(std::memory_order_acquire);
      for (int spins = 0; generation == seen; ++spins) {
        spin_pause();
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() > spin_end) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          {
            std::unique_lock<std::mutex> lock(sleep_);
            wake_.wait(lock,
                       [&] { return step_.generation.load(std::memory_order_seq_cst) != seen; });
          }
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
        generation = step_.generation.load(std::memory_order_acquire);
      }
      seen = generation;
      if (index + 1 < step_.parts) {
        try {
          step_.invoke(step_.body, index + 1);
        } catch (...) {
          self.failure = std::current_exception();
        }
      }
      self.done.store(generation, std::memory_order_release);
    }
  }

  // Held by the thread inside run.
  std::mutex use_;
  // The step, on one cache line: run writes the body and the parts, then publishes the
  // generation, which the helpers read first.
  struct alignas(64) Step {
    std::atomic<std::uint64_t> generation{0};
    void* body = nullptr;
    void (*invoke)(void*, int) = nullptr;
    int parts = 0;
  };
  Step step_;
  alignas(64) std::atomic<int> sleepers_{0};
  std::mutex sleep_;
  std::condition_variable wake_;
  std::vector<std::unique_ptr<Helper>> helpers_;
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_THREAD_TEAM_HPP
