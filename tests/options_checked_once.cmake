# The loader's options are checked in one place (ferry::detail::normalize_options, src/options.cpp):
# the front-ends (the Python module, python/src, the Python package, python/ferry, and the ferry tool) convert
# their arguments and pass them through. This fails when one of them checks a library option again or re-derives one from
# another (a second message for the same rule drifts from the first). Invoked by CTest.
set(options batch_size num_workers prefetch_factor pin_threads pin_depth device_prefetch gpu_decode_threads
            max_error_fraction pinned_memory_limit intra_batch_threads io_retries)
file(GLOB package RELATIVE ${SOURCE} ${SOURCE}/python/ferry/*.py)
foreach(file python/src/module.cpp python/src/loader.cpp python/src/datasets.cpp tools/ferry/ferry.cpp ${package})
  file(READ ${SOURCE}/${file} text)
  foreach(o IN LISTS options)
    if(text MATCHES "${o} must be")
      message(FATAL_ERROR "${file} checks the library option ${o} itself; leave it to ferry::detail::normalize_options")
    endif()
  endforeach()
  if(text MATCHES "pin_memory = [^;\n]*(\\|\\||device)" OR text MATCHES "pin_memory ?= ?[^;\n,]* or [^;\n,]*device")
    message(FATAL_ERROR "${file} derives pin_memory from device itself; normalize_options does (a device implies pinning)")
  endif()
  if(text MATCHES "device must be a CUDA device index")
    message(FATAL_ERROR "${file} checks device itself; leave it to normalize_options")
  endif()
endforeach()
file(READ ${SOURCE}/src/options.cpp rules)
foreach(o IN LISTS options)
  if(NOT rules MATCHES "${o}")
    message(FATAL_ERROR "src/options.cpp has no rule naming ${o}")
  endif()
endforeach()
message("options: ${options} checked in src/options.cpp only")
