# Runs a draws_dump executable and compares its output byte for byte with the golden file.
#
#   cmake -D DUMP=<executable> -D GOLDEN=<tests/draws/golden.txt> -D ACTUAL=<file to write>
#         [-D LABEL=<what was built>] -P compare.cmake
#
# Also included by run_other_compiler.cmake, which sets the same variables.
cmake_minimum_required(VERSION 3.21)

execute_process(COMMAND ${DUMP} OUTPUT_VARIABLE actual RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "${DUMP} failed (${result})")
endif()
file(WRITE ${ACTUAL} "${actual}")
file(READ ${GOLDEN} golden)
if(NOT actual STREQUAL golden)
  message(FATAL_ERROR "draws of ${LABEL} differ from ${GOLDEN}; the output is in ${ACTUAL} "
                      "(compare with: diff ${GOLDEN} ${ACTUAL})")
endif()
message(STATUS "draws of ${LABEL} equal ${GOLDEN} byte for byte")
