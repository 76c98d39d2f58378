# ctest driver: the out-of-tree plugin example (docs/writing-a-plugin.md) configured against this
# build folder (-Dkvlab_DIR, nothing installed), listed by the build's kvlab, and its KV policy
# run in the engine on a small quickstart.
file(REMOVE_RECURSE ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/run_command.cmake)
run(${CMAKE_COMMAND} -S ${PLUGIN_EXAMPLE_DIR} -B ${WORK_DIR}/plugin_build -Dkvlab_DIR=${KVLAB_BINARY_DIR}
    -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/plugin_build)
run(${KVLAB_BINARY_DIR}/bin/kvlab plugins --path ${WORK_DIR}/plugin_build)
if(NOT last_output MATCHES "kv_policy strided" OR NOT last_output MATCHES "allocator slot_list")
  message(FATAL_ERROR "the build's kvlab did not list the plugins built against it:\n${last_output}")
endif()
run(${KVLAB_BINARY_DIR}/bin/kvlab run ${QUICKSTART} --set "model.name=\"tiny\"" --set "workload.requests=6"
    --set "kv_policy={name=\"strided\", params={budget=8}}"
    --set "kv_cache.params={block_size=4, prefix_caching=false}" --set "backend.threads=1"
    --set "experiment.plugin_paths=[\"${WORK_DIR}/plugin_build\"]" --out ${WORK_DIR}/results)
if(NOT last_output MATCHES "scheduler.name=fcfs \\| 6 \\| 0")
  message(FATAL_ERROR "the strided KV policy did not finish every request:\n${last_output}")
endif()
