// The half instances that tests/kernel_instances.hpp declares (one file per type, so that a
// parallel build compiles them side by side).

#include "kernel_instances.hpp"

PLSH_TEST_KERNEL_INSTANCES(template, Eigen::half)
PLSH_TEST_INNER_INSTANCES(template, Eigen::half)
