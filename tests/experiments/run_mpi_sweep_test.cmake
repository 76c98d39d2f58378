# A sweep run by 3 MPI ranks writes exactly the results folder one process writes (every file
# byte for byte but manifest.json, which records the rank count and the time, and the marker,
# which records each file's modification time), prints the
# same table, and reports the runs that fail (a model folder whose weights are truncated) with
# the rank that ran them while keeping the others' results.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/badmodel)
file(COPY ${SOURCE_DIR}/tests/fixtures/hf/tiny_llama_gqa/config.json DESTINATION ${WORK_DIR}/badmodel)
file(WRITE ${WORK_DIR}/badmodel/model.safetensors "not a safetensors file")
file(WRITE ${WORK_DIR}/sweep.toml "[experiment]
name = \"mpi_sweep\"
seed = 3
repeats = 2
[model]
name = \"tiny\"
[backend]
threads = 1
profile = \"cpu\"
[workload]
requests = 12
arrival = \"poisson\"
rate = 40.0
prompt_tokens = { dist = \"uniform\", min = 4, max = 24 }
output_tokens = { dist = \"uniform\", min = 2, max = 16 }
[[sweep]]
key = \"scheduler.name\"
values = [\"fcfs\", \"static\", \"chunked\"]
[[sweep]]
key = \"model.name\"
values = [\"tiny\", \"${WORK_DIR}/badmodel\"]
[[sweep]]
key = \"backend.name\"
values = [\"cpu\", \"simulated\"]
")
execute_process(COMMAND ${KVLAB} run ${WORK_DIR}/sweep.toml --out ${WORK_DIR}/one
                RESULT_VARIABLE one_result OUTPUT_VARIABLE one_out ERROR_VARIABLE one_err)
# root needs --allow-run-as-root; --oversubscribe: 3 ranks on a 2-core machine.
execute_process(COMMAND ${MPIEXEC} -n 3 --oversubscribe --allow-run-as-root
                        ${KVLAB} run ${WORK_DIR}/sweep.toml --out ${WORK_DIR}/three
                RESULT_VARIABLE three_result OUTPUT_VARIABLE three_out ERROR_VARIABLE three_err)
if(one_result EQUAL 0 OR three_result EQUAL 0)
  message(FATAL_ERROR "a sweep with failing runs exited 0 (one: ${one_result}, three: ${three_result})")
endif()
foreach(err one_err three_err)
  string(REGEX MATCHALL "failed[^:]*: bad safetensors file" failures "${${err}}")
  list(LENGTH failures count)
  if(NOT count EQUAL 6)  # 3 schedulers x 2 repeats of the cpu backend on the bad folder
    message(FATAL_ERROR "${err}: expected 6 failed runs, got ${count}:\n${${err}}")
  endif()
endforeach()
if(NOT three_err MATCHES "failed on rank [0-2]: bad safetensors file")
  message(FATAL_ERROR "the ranks' failures do not name the rank:\n${three_err}")
endif()
string(REPLACE "${WORK_DIR}/one" "RESULTS" one_out "${one_out}")
string(REPLACE "${WORK_DIR}/three" "RESULTS" three_out "${three_out}")
if(NOT one_out STREQUAL three_out)
  message(FATAL_ERROR "tables differ:\n--- one process\n${one_out}\n--- three ranks\n${three_out}")
endif()
file(GLOB_RECURSE one_files RELATIVE ${WORK_DIR}/one ${WORK_DIR}/one/*)
file(GLOB_RECURSE three_files RELATIVE ${WORK_DIR}/three ${WORK_DIR}/three/*)
list(SORT one_files)
list(SORT three_files)
if(NOT one_files STREQUAL three_files)
  message(FATAL_ERROR "file lists differ:\n${one_files}\n${three_files}")
endif()
list(LENGTH one_files count)
if(count LESS 90)  # 18 runs x 5 files, and the folder's own
  message(FATAL_ERROR "only ${count} files written")
endif()
foreach(f ${one_files})
  if(f STREQUAL "manifest.json" OR f STREQUAL ".kvlab-results.json")  # times, file stamps
    continue()
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${WORK_DIR}/one/${f} ${WORK_DIR}/three/${f}
                  RESULT_VARIABLE differ)
  if(differ)
    message(FATAL_ERROR "${f} differs between one process and three ranks")
  endif()
endforeach()
file(READ ${WORK_DIR}/three/manifest.json manifest)
if(NOT manifest MATCHES "\"ranks\": 3")
  message(FATAL_ERROR "manifest.json does not record 3 ranks:\n${manifest}")
endif()
message(STATUS "3 ranks = 1 process: ${count} files, the same table, 6 failures reported")
