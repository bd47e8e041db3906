# Builds tests/draws/draws_dump.cpp with another C++ compiler than the main build's and compares
# its output with the golden file (compare.cmake).
#
#   cmake -D OTHER_CXX=<compiler or empty> -D PLSH_SOURCE_DIR=... -D WORK_DIR=... -D GOLDEN=...
#         [-D GENERATOR=...] [-D MAKE_PROGRAM=...] [-D EIGEN3_DIR=...] [-D EXECUTABLE_SUFFIX=...]
#         -P run_other_compiler.cmake
#
# Without OTHER_CXX it prints "plsh: SKIP" (the ctest test's SKIP_REGULAR_EXPRESSION).
cmake_minimum_required(VERSION 3.21)

if(NOT OTHER_CXX)
  message("plsh: SKIP: no second C++ compiler (install clang, or g++) to compare the draws with")
  return()
endif()

set(CXX_COMPILER ${OTHER_CXX})
include(${CMAKE_CURRENT_LIST_DIR}/../package/configure_args.cmake)
set(args ${common_args} -DPLSH_SOURCE_DIR=${PLSH_SOURCE_DIR})

file(REMOVE_RECURSE ${WORK_DIR})
foreach(step IN ITEMS configure build)
  if(step STREQUAL "configure")
    set(command ${CMAKE_COMMAND} -S ${PLSH_SOURCE_DIR}/tests/draws -B ${WORK_DIR} ${args})
  else()
    set(command ${CMAKE_COMMAND} --build ${WORK_DIR})
  endif()
  execute_process(COMMAND ${command} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${step} of draws_dump with ${OTHER_CXX} failed (${result})")
  endif()
endforeach()

set(DUMP ${WORK_DIR}/bin/draws_dump${EXECUTABLE_SUFFIX})
set(ACTUAL ${WORK_DIR}/draws.txt)
set(LABEL "draws_dump built with ${OTHER_CXX}")
include(${CMAKE_CURRENT_LIST_DIR}/compare.cmake)
