# Builds and runs a consumer project against plsh, as a user would.
#
#   cmake -D MODE=installed|subdirectory -D PLSH_SOURCE_DIR=... -D CONSUMER_SOURCE_DIR=...
#         -D WORK_DIR=... [-D PLSH_VERSION=...] [-D GENERATOR=...] [-D MAKE_PROGRAM=...]
#         [-D CXX_COMPILER=...] [-D EIGEN3_DIR=...] [-D EXECUTABLE_SUFFIX=...]
#         -P run_consumer.cmake
#
# installed:    copy the files a plsh package is made of (not tests/, examples/, bench/)
#               into WORK_DIR/source, configure it with tests, examples and benchmarks
#               OFF, install it into WORK_DIR/prefix, then configure the consumer with
#               CMAKE_PREFIX_PATH=WORK_DIR/prefix (find_package(plsh CONFIG)).
# subdirectory: configure the consumer, which calls add_subdirectory(PLSH_SOURCE_DIR).
#
# In both modes the consumer is built and its executable run; any failing step fails
# the script (and so the ctest test). The consumer builds as a user's Debug build: assertions
# on (Eigen's and the standard library's), and no optimiser time spent on a program that runs
# a tiny problem once.
cmake_minimum_required(VERSION 3.16)

foreach(required IN ITEMS MODE PLSH_SOURCE_DIR CONSUMER_SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${required} OR "${${required}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: ${required} is not set")
  endif()
endforeach()
if(NOT MODE MATCHES "^(installed|subdirectory)$")
  message(FATAL_ERROR "run_consumer.cmake: MODE must be installed or subdirectory, not '${MODE}'")
endif()

set(config Debug)

# Options shared by every configure step: same generator and compiler as the outer build.
set(BUILD_TYPE ${config})
include(${CMAKE_CURRENT_LIST_DIR}/configure_args.cmake)

function(run_step description)
  message(STATUS "[${MODE}] ${description}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result COMMAND_ECHO STDOUT)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "[${MODE}] ${description} failed (${result})")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

set(consumer_args)

if(MODE STREQUAL "installed")
  set(source ${WORK_DIR}/source)
  set(prefix ${WORK_DIR}/prefix)
  file(MAKE_DIRECTORY ${source})
  foreach(entry IN ITEMS CMakeLists.txt cmake include LICENSE)
    if(NOT EXISTS ${PLSH_SOURCE_DIR}/${entry})
      message(FATAL_ERROR "[${MODE}] ${PLSH_SOURCE_DIR}/${entry} is missing")
    endif()
    file(COPY ${PLSH_SOURCE_DIR}/${entry} DESTINATION ${source})
  endforeach()

  run_step("configure plsh"
    ${CMAKE_COMMAND} -S ${source} -B ${WORK_DIR}/plsh-build ${common_args}
      -DCMAKE_INSTALL_PREFIX=${prefix}
      -DPLSH_BUILD_TESTS=OFF -DPLSH_BUILD_EXAMPLES=OFF -DPLSH_BUILD_BENCHMARKS=OFF)
  run_step("build plsh" ${CMAKE_COMMAND} --build ${WORK_DIR}/plsh-build --config ${config})
  run_step("install plsh"
    ${CMAKE_COMMAND} --install ${WORK_DIR}/plsh-build --config ${config} --prefix ${prefix})

  foreach(header IN ITEMS plsh.hpp analysis.hpp reference.hpp)
    if(NOT EXISTS ${prefix}/include/plsh/${header})
      message(FATAL_ERROR "[${MODE}] ${prefix}/include/plsh/${header} was not installed")
    endif()
  endforeach()
  foreach(package_file IN ITEMS plshConfig.cmake plshConfigVersion.cmake plshTargets.cmake)
    file(GLOB_RECURSE found LIST_DIRECTORIES false "${prefix}/*/${package_file}")
    if(NOT found)
      message(FATAL_ERROR "[${MODE}] ${package_file} was not installed under ${prefix}")
    endif()
    message(STATUS "[${MODE}] installed ${found}")
  endforeach()

  list(APPEND consumer_args -DCMAKE_PREFIX_PATH=${prefix} -DPLSH_EXPECTED_PREFIX=${prefix})
  if(PLSH_VERSION)
    list(APPEND consumer_args -DPLSH_REQUIRED_VERSION=${PLSH_VERSION})
  endif()
else()
  list(APPEND consumer_args -DPLSH_SOURCE_DIR=${PLSH_SOURCE_DIR})
endif()

set(consumer_build ${WORK_DIR}/consumer-build)
run_step("configure consumer"
  ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${consumer_build} ${common_args} ${consumer_args})
run_step("build consumer" ${CMAKE_COMMAND} --build ${consumer_build} --config ${config})
run_step("run consumer" ${consumer_build}/bin/plsh_consumer${EXECUTABLE_SUFFIX})
