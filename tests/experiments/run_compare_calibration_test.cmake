# Runs calibration.toml small (tiny model, the shipped cpu profile) and compares its measured
# and simulated runs: three workloads paired, the validation line printed; a folder without a
# measured/virtual pair is exit status 2 with a reason.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${KVLAB} run ${SOURCE_DIR}/experiments/calibration.toml --set workload.requests=8
                        --set model.name=tiny --set backend.threads=1 --set experiment.repeats=2
                        --set backend.profile=\"cpu\" --out ${WORK_DIR}/pairs
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "kvlab run failed: ${out}${err}")
endif()
find_program(python NAMES python3 REQUIRED)
execute_process(COMMAND ${python} ${SOURCE_DIR}/experiments/compare_calibration.py ${WORK_DIR}/pairs
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "compare_calibration.py failed: ${out}${err}")
endif()
string(REGEX MATCHALL "\\| 2 \\+ 2 \\|" pairs "${out}")
list(LENGTH pairs count)
if(NOT count EQUAL 3)
  message(FATAL_ERROR "expected 3 workloads of 2 measured + 2 simulated runs:\n${out}")
endif()
foreach(workload "workload.arrival=poisson, workload.rate=40.0" "workload.arrival=all_at_once")
  string(FIND "${out}" "${workload}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "workload ${workload} missing:\n${out}")
  endif()
endforeach()
# The measured runs' median step over its predicted price, one per workload.
string(REGEX MATCHALL "\\| [0-9]+\\.[0-9][0-9] \\(median step\\) \\|" steps "${out}")
list(LENGTH steps count)
if(NOT count EQUAL 3)
  message(FATAL_ERROR "expected the median step ratio of 3 workloads:\n${out}")
endif()
if(NOT out MATCHES "[0-6] of 6 predictions of output tok/s and TTFT p50 within 10% of the measured runs")
  message(FATAL_ERROR "no validation line:\n${out}")
endif()
# Two folders (a GPU's measured run and its simulated replay are two kvlab runs): the quickstart
# measured on the cpu backend, then simulated; its two schedulers pair across the folders.
set(small --set workload.requests=8 --set model.name=tiny --set backend.threads=1
          --set workload.ignore_eos=true --set backend.profile=\"cpu\")
foreach(side "measured;experiment.clock=\"measured\"" "simulated;backend.name=\"simulated\"")
  list(GET side 0 folder)
  list(GET side 1 setting)
  execute_process(COMMAND ${KVLAB} run ${SOURCE_DIR}/experiments/quickstart.toml ${small}
                          --set ${setting} --out ${WORK_DIR}/${folder}
                  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "kvlab run (${folder}) failed: ${out}${err}")
  endif()
endforeach()
execute_process(COMMAND ${python} ${SOURCE_DIR}/experiments/compare_calibration.py
                        ${WORK_DIR}/measured ${WORK_DIR}/simulated
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(REGEX MATCHALL "\\| scheduler.name=(static|fcfs) \\| 1 \\+ 1 \\|" pairs "${out}")
list(LENGTH pairs count)
if(NOT result EQUAL 0 OR NOT count EQUAL 2)
  message(FATAL_ERROR "expected static and fcfs paired across two folders: ${out}${err}")
endif()
if(NOT out MATCHES "[0-4] of 4 predictions of output tok/s and TTFT p50 within 10%")
  message(FATAL_ERROR "no validation line for two folders:\n${out}")
endif()
file(WRITE ${WORK_DIR}/empty/runs.json "[]")
execute_process(COMMAND ${python} ${SOURCE_DIR}/experiments/compare_calibration.py ${WORK_DIR}/empty
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 2 OR NOT err MATCHES "no workload run both on a measured and on a virtual clock")
  message(FATAL_ERROR "a folder without pairs: exit ${result}, ${out}${err}")
endif()
