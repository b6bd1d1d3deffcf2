# The demo stopped mid-epoch (as a preempted job) and resumed from its checkpoint ends the epoch
# with the same test loss and accuracy as an uninterrupted run: the loader went on with the very
# batches, in order, with the same augmentations, and the model from its saved weights.
# cmake -DDEMO=<train_fashion_mnist> -DDATA=<dir> -DWORK=<scratch dir> -P resume_test.cmake
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${DEMO} --cpu --data ${DATA} --epochs 1 --workers 2 OUTPUT_VARIABLE whole RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "uninterrupted run failed (${rc})")
endif()
execute_process(COMMAND ${DEMO} --cpu --data ${DATA} --epochs 1 --workers 2 --checkpoint-dir ${WORK} --checkpoint-every 100
                        --stop-after 150 RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT EXISTS ${WORK}/loader.state)
  message(FATAL_ERROR "the stopped run failed (${rc}) or left no checkpoint")
endif()
execute_process(COMMAND ${DEMO} --cpu --data ${DATA} --epochs 1 --workers 3 --checkpoint-dir ${WORK} --resume
                OUTPUT_VARIABLE resumed RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the resumed run failed (${rc})")
endif()
string(REGEX MATCH "test loss [0-9.]+, test accuracy [0-9.]+%" a "${whole}")
string(REGEX MATCH "test loss [0-9.]+, test accuracy [0-9.]+%" b "${resumed}")
string(FIND "${resumed}" "after batch 100 of 469" at)
if(a STREQUAL "" OR NOT a STREQUAL b OR at EQUAL -1)
  message(FATAL_ERROR "uninterrupted: '${a}'; resumed: '${b}'\n${resumed}")
endif()
message(STATUS "resumed run matches: ${b}")
