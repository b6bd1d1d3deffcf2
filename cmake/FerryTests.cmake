# What every CTest entry of the project holds to, checked as each directory that adds tests ends
# (a directory calls `cmake_language(DEFER CALL ferry_finish_tests)` first):
# * every test carries a label (`ctest -L cpu`, `-L gpu` and the README's selections find it);
# * a test judged by its output (PASS_REGULAR_EXPRESSION, which makes CTest ignore the exit status)
#   fails on a sanitizer's or UBSan's report in that output, as an exit-judged test fails on the
#   report's exit status (the tsan and asan presets' halt_on_error);
# * WILL_FAIL, which would turn such a report into a pass, is not used: a command expected to fail
#   runs under ferry_expect_failure(), which inverts its exit status and keeps its output.
set(FERRY_SANITIZER_REPORTS
    "WARNING: ThreadSanitizer:" "ERROR: AddressSanitizer:" "ERROR: LeakSanitizer:" "runtime error: "
    "SUMMARY: [A-Za-z]+Sanitizer")
# The command that runs `cmd args...` and succeeds exactly when it fails (its output kept).
set(FERRY_EXPECT_FAILURE sh -c "! \"$@\"" ferry-expect-failure)

function(ferry_finish_tests)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(t IN LISTS tests)
    get_test_property(${t} LABELS labels)
    if(NOT labels)
      message(FATAL_ERROR "ferry: test '${t}' (${CMAKE_CURRENT_SOURCE_DIR}) has no LABELS; every test carries one")
    endif()
    get_test_property(${t} WILL_FAIL will_fail)
    if(will_fail)
      message(FATAL_ERROR "ferry: test '${t}' uses WILL_FAIL, which passes on a sanitizer's report; run it under \${FERRY_EXPECT_FAILURE}")
    endif()
    get_test_property(${t} PASS_REGULAR_EXPRESSION pass)
    if(pass)
      get_test_property(${t} FAIL_REGULAR_EXPRESSION fail)
      if(NOT fail)
        set(fail "")
      endif()
      list(APPEND fail ${FERRY_SANITIZER_REPORTS})
      set_tests_properties(${t} PROPERTIES FAIL_REGULAR_EXPRESSION "${fail}")
    endif()
  endforeach()
endfunction()
