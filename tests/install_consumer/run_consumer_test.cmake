# ctest driver: cmake --install the build tree into WORK_DIR/prefix, then build and run the
# consumer project against it.
file(REMOVE_RECURSE ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/run_command.cmake)
run(${CMAKE_COMMAND} --install ${KVLAB_BINARY_DIR} --prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
    -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
# The out-of-tree plugin example (docs/writing-a-plugin.md) builds against the installed
# package, and the installed kvlab lists it next to the shipped plugins.
run(${CMAKE_COMMAND} -S ${PLUGIN_EXAMPLE_DIR} -B ${WORK_DIR}/plugin_build -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
    -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/plugin_build)
execute_process(COMMAND ${WORK_DIR}/prefix/bin/kvlab plugins --path ${WORK_DIR}/plugin_build
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "${out}${err}")
if(NOT result EQUAL 0 OR NOT out MATCHES "attention fixed_kv_heads" OR NOT out MATCHES "scheduler longest_prompt_first"
   OR NOT out MATCHES "allocator slot_list" OR NOT out MATCHES "kv_policy strided"
   OR NOT out MATCHES "allocator paged")
  message(FATAL_ERROR "installed kvlab did not list the out-of-tree plugins and the shipped ones")
endif()
# The out-of-tree allocator passes the installed conformance suite.
run(${WORK_DIR}/prefix/bin/kvlab plugins conformance slot_list --path ${WORK_DIR}/plugin_build --release-window)
# ... and the out-of-tree allocator and scheduler serve requests whose every greedy token equals
# the reference's (kvlab check on a small quickstart).
run(${WORK_DIR}/prefix/bin/kvlab check ${QUICKSTART} --set "kv_cache.allocator=\"slot_list\""
    --set "kv_cache.params={}" --set "scheduler.params={}" --set "model.name=\"tiny\""
    --set "workload.requests=6" --set "experiment.plugin_paths=[\"${WORK_DIR}/plugin_build\"]"
    --set "sweep=[{key=\"scheduler.name\", values=[\"longest_prompt_first\", \"fcfs\"]}]")
