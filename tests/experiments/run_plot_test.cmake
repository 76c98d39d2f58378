# Runs the preemption experiment (simulated: under a second; it has recompute and swap
# preemptions) and plots it; tests/experiments/test_plot.py then checks plot.py's labels, axes,
# waste bars and preemption markers against the run.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${KVLAB} run ${SOURCE_DIR}/experiments/preemption.toml
                        --set backend.name=simulated --set backend.profile=cpu --out ${WORK_DIR}
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
execute_process(COMMAND ${python} ${SOURCE_DIR}/tests/experiments/test_plot.py ${WORK_DIR}
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "test_plot.py failed: ${out}${err}")
endif()
