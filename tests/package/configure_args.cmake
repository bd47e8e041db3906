# Included by the scripts that configure a small project from a ctest test (run_consumer.cmake,
# ../draws/run_other_compiler.cmake): sets `common_args`, the options of every configure step,
# from the variables GENERATOR, MAKE_PROGRAM, CXX_COMPILER, EIGEN3_DIR and BUILD_TYPE (each
# optional; the build type is Release unless BUILD_TYPE says otherwise).
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
set(common_args -DCMAKE_BUILD_TYPE=${BUILD_TYPE})
if(GENERATOR)
  list(APPEND common_args -G ${GENERATOR})
endif()
if(MAKE_PROGRAM)
  list(APPEND common_args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
if(CXX_COMPILER)
  list(APPEND common_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
if(EIGEN3_DIR)
  list(APPEND common_args -DEigen3_DIR=${EIGEN3_DIR})
endif()
