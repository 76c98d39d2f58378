# Writes OUT (a header defining KVLAB_COMMIT) from `git describe` of SOURCE_DIR, touching it only
# when the text changes, so a rebuild after a commit records the new commit without recompiling
# everything on every build. Outside a git checkout the commit is "unknown".
execute_process(COMMAND git -C "${SOURCE_DIR}" describe --always --dirty --abbrev=12
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE
                RESULT_VARIABLE failed ERROR_QUIET)
if(failed OR commit STREQUAL "")
  set(commit "unknown")
endif()
set(text "#pragma once\n#define KVLAB_COMMIT \"${commit}\"\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
