#ifndef PLSH_DECODE_DECODE_MODE_HPP
#define PLSH_DECODE_DECODE_MODE_HPP

/// \file decode_mode.hpp
/// DecodeModeChoice: whether a cache's one-token decoding steps run on all threads or on the
/// calling thread alone, whichever is measured faster. A split step is only faster while the
/// helper thread has a core to itself; on a busy machine (more runnable threads than cores) its
/// step waits for a helper that is not running, and the calling thread alone is faster by far.
///
/// Cost: two clock reads every kDecodeMeasureEvery steps and at each step of a probe; a probe of
/// kDecodeProbeSteps steps every kDecodeProbeEvery steps. The outputs do not depend on the mode.
/// Tested through KvCache in tests/test_kv_cache_decode.cpp (one-token steps at 1 and 2 threads,
/// bit for bit, over steps of both modes).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace plsh {
namespace detail {

/// Steps between probes of the mode that does not run.
constexpr std::uint64_t kDecodeProbeEvery = 4096;
/// Steps between measurements of the mode that runs.
constexpr std::uint64_t kDecodeMeasureEvery = 16;
/// Steps of a probe: the first ones wake the helpers and bring the data into their caches...
constexpr int kDecodeProbeSteps = 8;
/// ... the last kDecodeProbeMeasured of them decide, by their median.
constexpr int kDecodeProbeMeasured = 4;
/// A step of a probe this many times slower than the running mode ends the probe.
constexpr double kDecodeProbeAbort = 4;
/// The weight of the newest measurement in the running mode's smoothed speed.
constexpr double kDecodeSpeedSmoothing = 0.125;

/// Which of two modes runs a one-token decoding step when more than one thread is available:
/// all threads (parallel) or the calling thread alone, by the measured speed of each (work per
/// second of whole steps):
/// - the mode that runs is measured at the last of every kDecodeMeasureEvery steps, smoothed by
///   kDecodeSpeedSmoothing;
/// - every kDecodeProbeEvery steps the other mode runs kDecodeProbeSteps steps (a probe), whose
///   speed is the median of the last kDecodeProbeMeasured; a step of the probe after its first
///   that is kDecodeProbeAbort times slower than the running mode ends the probe;
/// - at first parallel runs until it is measured, then a probe measures the calling thread.
/// Steps whose work cannot be measured (too little to split: work 0) change nothing.
struct DecodeModeChoice {
  struct Step {
    bool parallel;
    bool measured;
    int probe_step;  // the step's place in a probe, 0 .. kDecodeProbeSteps - 1; else -1
  };
  double speed[2] = {0, 0};       // [0]: the calling thread alone, [1]: parallel; 0: not measured
  std::uint64_t since_probe = 0;  // steps of the faster mode since the last probe
  int probe_left = 0;             // steps left of the running probe
  double samples[kDecodeProbeMeasured] = {};  // the probe's deciding speeds; 0: not measurable

  /// `work` per second for `work` done in `seconds`; 0 when it cannot be measured.
  static double measured_speed(double work, double seconds) {
    return seconds > 0 && work > 0 ? work / seconds : 0;
  }

  bool parallel_faster() const { return !(speed[1] > 0 && speed[0] > speed[1]); }

  /// The mode of the next step, and whether to time it.
  Step next() {
    if (probe_left == 0 && speed[1] > 0 &&
        (!(speed[0] > 0) || since_probe + 1 >= kDecodeProbeEvery)) {
      probe_left = kDecodeProbeSteps;
      since_probe = 0;
      std::fill(samples, samples + kDecodeProbeMeasured, 0.0);
    }
    if (probe_left > 0) {
      const int place = kDecodeProbeSteps - probe_left--;
      return Step{!parallel_faster(), place > 0, place};
    }
    ++since_probe;
    return Step{parallel_faster(), since_probe % kDecodeMeasureEvery == 0, -1};
  }

  /// Records a timed step: `work` done in `seconds`.
  void record(const Step& step, double work, double seconds) {
    double& mode_speed = speed[step.parallel ? 1 : 0];
    const double measured = measured_speed(work, seconds);
    if (step.probe_step < 0) {
      if (measured > 0) {
        mode_speed = mode_speed > 0 ? mode_speed + kDecodeSpeedSmoothing * (measured - mode_speed)
                                    : measured;
      }
      return;
    }
    constexpr int first_sample = kDecodeProbeSteps - kDecodeProbeMeasured;
    if (step.probe_step >= first_sample) {
      samples[step.probe_step - first_sample] = measured;
    } else if (measured > 0 && measured * kDecodeProbeAbort < speed[step.parallel ? 0 : 1]) {
      mode_speed = measured;
      probe_left = 0;
      return;
    }
    if (step.probe_step + 1 < kDecodeProbeSteps) return;
    // The median of the measurable samples (a preempted step does not decide).
    double sorted[kDecodeProbeMeasured];
    const std::ptrdiff_t count = std::copy_if(samples, samples + kDecodeProbeMeasured, sorted,
                                              [](double sample) { return sample > 0; }) -
                                 sorted;
    if (count == 0) return;
    // Insertion sort: GCC 12 warns of bounds in std::sort's code for arrays this short.
    for (std::ptrdiff_t i = 1; i < count; ++i) {
      for (std::ptrdiff_t j = i; j > 0 && sorted[j - 1] > sorted[j]; --j) {
        std::swap(sorted[j - 1], sorted[j]);
      }
    }
    mode_speed = 0.5 * (sorted[(count - 1) / 2] + sorted[count / 2]);
  }
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DECODE_DECODE_MODE_HPP
