# Each option and each statistic is declared once, in the library; this fails when that drifts:
#  * every DataLoaderOptions member has documentation (a /// comment on or above it);
#  * every keyword of the Python module's make_options names a DataLoaderOptions member (or one of
#    the front-end spellings below), so Python adds no option of its own;
#  * every key of the `ferry` tool's JSON "options" object names a DataLoaderOptions member;
#  * every LoaderStats field is in LoaderStats::for_each, the one list the Python dict and the
#    tool's JSON are made from.
cmake_minimum_required(VERSION 3.25)
# Invoked by CTest with -DSOURCE=<the source tree>.
# The data members of `struct name` in `header`, into `out`; with `documented`, each must have a
# /// comment on its line or the line above.
function(members_of header name out documented)
  file(STRINGS ${SOURCE}/${header} lines)
  set(in_struct OFF)
  set(previous "")
  set(found "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^struct ${name}")
      set(in_struct ON)
    elseif(in_struct AND line MATCHES "^};")
      set(in_struct OFF)
    elseif(in_struct AND line MATCHES "^  [A-Za-z:<>_, 0-9]+ ([a-z_0-9]+)( = [^;]*|{[^}]*})?;")
      set(member ${CMAKE_MATCH_1})
      list(APPEND found ${member})
      if(documented AND NOT line MATCHES "///" AND NOT previous MATCHES "^  ///")
        message(FATAL_ERROR "${name}::${member} has no documentation (a /// comment above it): ${header}")
      endif()
    endif()
    if(NOT line STREQUAL "")
      set(previous "${line}")
    endif()
  endforeach()
  set(${out} ${found} PARENT_SCOPE)
endfunction()

members_of(include/ferry/core/options.h DataLoaderOptions members ON)
list(LENGTH members count)
if(count LESS 20)
  message(FATAL_ERROR "found only ${count} DataLoaderOptions members; has options.h's layout changed?")
endif()

# The Python module's keywords.
file(READ ${SOURCE}/python/src/loader.cpp module)
string(REGEX MATCH "m\\.def\\(\"make_options\"[^;]*;" call "${module}")
if(NOT call)
  message(FATAL_ERROR "python/src/loader.cpp: no m.def(\"make_options\", ...) found")
endif()
string(REGEX MATCHALL "\"([a-z_0-9]+)\"_a" keywords "${call}")
set(front_end_spellings stream trace_batches)  # consumer_stream and trace, in Python's terms
foreach(k IN LISTS keywords)
  string(REGEX REPLACE "\"([a-z_0-9]+)\"_a" "\\1" k "${k}")
  if(NOT k IN_LIST members AND NOT k IN_LIST front_end_spellings)
    message(FATAL_ERROR "the Python module's make_options takes '${k}', which is not a DataLoaderOptions member: declare "
                        "the option in include/ferry/core/options.h and pass it through")
  endif()
endforeach()

# The tool's JSON options.
file(READ ${SOURCE}/tools/ferry/ferry.cpp tool)
string(FIND "${tool}" "{\"options\"," begin)
string(SUBSTRING "${tool}" ${begin} -1 json)
string(FIND "${json}" "}}}" end)
string(SUBSTRING "${json}" 0 ${end} json)
string(REGEX MATCHALL "{\"([a-z_0-9]+)\"," keys "${json}")
foreach(k IN LISTS keys)
  string(REGEX REPLACE "{\"([a-z_0-9]+)\"," "\\1" k "${k}")
  if(NOT k STREQUAL "options" AND NOT k IN_LIST members)
    message(FATAL_ERROR "the ferry tool's JSON names option '${k}', which is not a DataLoaderOptions member")
  endif()
endforeach()

# LoaderStats.
file(READ ${SOURCE}/include/ferry/core/stats.h stats)
members_of(include/ferry/core/stats.h LoaderStats fields OFF)
foreach(name IN LISTS fields)
  string(FIND "${stats}" "fn(\"${name}\", ${name});" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "LoaderStats::${name} is missing from LoaderStats::for_each (include/ferry/core/stats.h): the "
                        "Python dict and the tool's JSON would not show it")
  endif()
endforeach()
list(LENGTH fields fields)
if(fields LESS 20)
  message(FATAL_ERROR "found only ${fields} LoaderStats fields; has stats.h's layout changed?")
endif()
message("${count} options documented; Python's keywords and the tool's JSON name library options; ${fields} statistics listed once")
