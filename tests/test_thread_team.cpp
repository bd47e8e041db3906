// Tests of detail::ThreadTeam (detail/thread_team.hpp): every part runs once per step, on its own
// thread, exceptions reach the caller, a busy team declines, sleeping helpers wake up, and a
// forked child declines.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <plsh/detail/thread_team.hpp>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace test_thread_team {

namespace {

using plsh::detail::ThreadTeam;

}  // namespace

TEST_CASE("ThreadTeam runs every part once per step, part 0 on the calling thread",
          "[thread_team]") {
  ThreadTeam& team = ThreadTeam::shared();
  constexpr int kMostParts = 4;
  constexpr int kSteps = 3000;
  std::vector<int> runs(kMostParts, 0);  // each written only by the thread of its part
  std::vector<std::thread::id> ids(kMostParts);
  int wrong_thread = 0;
  int shared_thread = 0;
  for (int step = 0; step < kSteps; ++step) {
    // 1 to 4 parts, so that steps with fewer parts than helpers come after the team has grown.
    const int parts = 1 + step % kMostParts;
    const bool ran = team.run(parts, [&](int part) {
      ++runs[static_cast<std::size_t>(part)];
      ids[static_cast<std::size_t>(part)] = std::this_thread::get_id();
    });
    REQUIRE(ran);
    if (ids[0] != std::this_thread::get_id()) ++wrong_thread;
    for (int a = 0; a < parts; ++a) {
      for (int b = a + 1; b < parts; ++b) {
        if (ids[static_cast<std::size_t>(a)] == ids[static_cast<std::size_t>(b)]) ++shared_thread;
      }
    }
  }
  INFO("part 0 off the calling thread in " << wrong_thread << " steps; two parts on one thread "
                                           << shared_thread << " times");
  CHECK(wrong_thread == 0);
  CHECK(shared_thread == 0);
  for (int part = 0; part < kMostParts; ++part) {
    INFO("part " << part);
    // Part p runs in the steps with more than p parts.
    CHECK(runs[static_cast<std::size_t>(part)] == kSteps / kMostParts * (kMostParts - part));
  }
}

TEST_CASE("ThreadTeam passes the first exception (in part order) on after every part is done",
          "[thread_team]") {
  ThreadTeam& team = ThreadTeam::shared();
  std::vector<int> finished(3, 0);
  const auto body = [&](int part) {
    if (part == 2) {
      // Part 1 throws first in time; part 2 throws later.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      finished[2] = 1;
      throw std::runtime_error("part 2");
    }
    finished[static_cast<std::size_t>(part)] = 1;
    if (part == 1) throw std::runtime_error("part 1");
  };
  std::string message;
  try {
    team.run(3, body);
  } catch (const std::runtime_error& error) {
    message = error.what();
  }
  CHECK(message == "part 1");
  CHECK(finished == std::vector<int>{1, 1, 1});
  // The team still works after a failed step, and the failure does not come back.
  int sum = 0;
  std::vector<int> values(3, 0);
  CHECK(team.run(3, [&](int part) { values[static_cast<std::size_t>(part)] = part + 1; }));
  for (const int value : values) sum += value;
  CHECK(sum == 6);
}

TEST_CASE("ThreadTeam declines a step while another is running", "[thread_team]") {
  ThreadTeam& team = ThreadTeam::shared();
  int inner_runs = 0;
  bool inner_ran = true;
  CHECK(team.run(2, [&](int part) {
    if (part == 0) inner_ran = team.run(2, [&](int) { ++inner_runs; });
  }));
  CHECK_FALSE(inner_ran);
  CHECK(inner_runs == 0);
}

TEST_CASE("ThreadTeam wakes helpers that went to sleep", "[thread_team]") {
  ThreadTeam& team = ThreadTeam::shared();
  std::atomic<int> runs{0};
  for (int step = 0; step < 5; ++step) {
    // Longer than the helpers spin, so they sleep before the next step.
    std::this_thread::sleep_for(ThreadTeam::kSpin * 4);
    REQUIRE(team.run(3, [&](int) { runs.fetch_add(1); }));
  }
  CHECK(runs.load() == 15);
}

TEST_CASE("ThreadTeam wakes sleeping helpers before the calling thread's part", "[thread_team]") {
  ThreadTeam& team = ThreadTeam::shared();
  REQUIRE(team.run(2, [](int) {}));  // the team has a helper
  std::this_thread::sleep_for(ThreadTeam::kSpin * 4);
  // Part 0 waits (at most 5 s) for part 1 to start: a helper woken only after part 0 would
  // start after that wait.
  std::atomic<bool> helper_started{false};
  bool seen_in_part_0 = false;
  REQUIRE(team.run(2, [&](int part) {
    if (part == 1) {
      helper_started.store(true);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!helper_started.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    seen_in_part_0 = helper_started.load();
  }));
  CHECK(seen_in_part_0);
}

#if defined(__unix__) || defined(__APPLE__)
TEST_CASE("ThreadTeam declines steps in a forked child, whose copy has no helpers",
          "[thread_team]") {
  ThreadTeam& team = ThreadTeam::shared();
  REQUIRE(team.run(2, [](int) {}));  // the team has a helper
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int runs = 0;
    const bool ran = team.run(2, [&](int) { ++runs; });
    _exit(!ran && runs == 0 ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  INFO("the child's exit status " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1)
                                  << " (0: run declined and ran nothing)");
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // The parent's team still works.
  std::atomic<int> runs{0};
  CHECK(team.run(2, [&](int) { runs.fetch_add(1); }));
  CHECK(runs.load() == 2);
}
#endif

}  // namespace test_thread_team
