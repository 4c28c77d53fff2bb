# Installs the posenc build in POSENC_BINARY_DIR into a fresh prefix, then configures, builds and
# runs the examples/ consumer against it with find_package(posenc).
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${POSENC_BINARY_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${POSENC_EXAMPLES_DIR} -B ${WORK_DIR}/build
                        -G ${CMAKE_GENERATOR} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring examples/ against the installed prefix failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building examples/ failed (${rc})")
endif()
execute_process(COMMAND ${WORK_DIR}/build/quickstart RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "examples/quickstart failed (${rc})")
endif()
if(NOT out MATCHES "all checks passed")
  message(FATAL_ERROR "examples/quickstart did not report success")
endif()
