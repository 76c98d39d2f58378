# experiments/vidur_validation.py on a small report in kvlab calibrate --vidur's columns: the
# tables' errors are the rows' |predicted / measured - 1| (mean, p90, max), fit and held-out
# models apart, the all-reduces in their own table.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
file(WRITE ${WORK_DIR}/report.csv
"gpu,model,role,kind,name,tp,tokens,kv_cache,bytes,measured_s,predicted_s
a100,A,fit,operator,attn_pre_proj,1,16,0,0,0.001,0.0011
a100,A,fit,operator,mlp_act,1,16,0,0,0.001,0.0008
a100,A,fit,layer,layer,1,16,0,0,0.002,0.0019
a100,B,held_out,operator,attn_pre_proj,2,16,0,0,0.001,0.00105
a100,B,held_out,operator,mlp_act,2,16,0,0,0.001,0.0013
a100,B,held_out,layer,layer,2,16,0,0,0.002,0.00235
a100,B,held_out,layer,layer,2,32,0,0,0.004,0.0042
a100,,fit,all_reduce,all_reduce,8,0,0,1024,0.00004,0.00005
")
find_program(python NAMES python3 REQUIRED)
execute_process(COMMAND ${python} ${SOURCE_DIR}/experiments/vidur_validation.py ${WORK_DIR}/report.csv
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "vidur_validation.py failed: ${out}${err}")
endif()
# Model A (fit): operators 10% and 20% (mean 15.0%), worst mlp_act; one layer 5%.
# Model B (held out): layers 17.5% and 5% (mean 11.2%, max 18%); operators 5% and 30%.
foreach(line
    "| a100 | A | fit | 1 | 15.0% | mlp_act (20.0%) | 5.0% | 5% | 5% |"
    "| a100 | B | held out | 2 | 17.5% | mlp_act (30.0%) | 11.2% | 18% | 18% |"
    "| a100 | mlp_act | 1 | 30.0% | 30% | 30% |"
    "| a100 | all-reduce, 8 GPUs |  | 1 | 25.0% | 25% | 25% |")
  string(FIND "${out}" "${line}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "expected the line\n${line}\nin:\n${out}")
  endif()
endforeach()
