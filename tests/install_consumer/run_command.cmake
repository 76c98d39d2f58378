# The install tests' drivers: run(COMMAND ...) runs a command, fails the test with its output
# when it fails, and leaves what it printed in `last_output`.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "command failed (${result}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
  set(last_output "${out}${err}" PARENT_SCOPE)
endfunction()
