# Runs a small quickstart and plots it; every PNG must exist and be non-empty.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${KVLAB} run ${SOURCE_DIR}/experiments/quickstart.toml --set workload.requests=8
                        --set model.name=tiny --set backend.threads=1 --out ${WORK_DIR}
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "kvlab run failed: ${out}${err}")
endif()
# Debian's interpreter, where python3-matplotlib installs (a pyenv python3 may shadow it on PATH).
if(EXISTS /usr/bin/python3)
  set(python /usr/bin/python3)
else()
  set(python python3)
endif()
execute_process(COMMAND ${python} ${SOURCE_DIR}/experiments/plot.py ${WORK_DIR}
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "plot.py failed: ${out}${err}")
endif()
foreach(png throughput_latency latency_cdf kv_usage kv_waste)
  file(SIZE ${WORK_DIR}/plots/${png}.png size)
  if(size LESS 1000)
    message(FATAL_ERROR "${png}.png is missing or empty")
  endif()
endforeach()
