# NCCL for the multi-GPU example and test (ferry's library never links it: the launchers and NCCL
# are the distributed engine ferry runs under). Defines the imported target ferry_nccl where
# nccl.h and libnccl are found: in the CUDA Toolkit (lib/ or lib64/), under FERRY_NCCL_ROOT (e.g.
# PyPI's nvidia-nccl-cu13 wheel: site-packages/nvidia/nccl), or on the default paths.
if(TARGET ferry_nccl OR NOT FERRY_HAVE_CUDA)
  return()
endif()
set(FERRY_NCCL_ROOT "" CACHE PATH "Where NCCL's include/ and lib/ are, if not in the CUDA Toolkit")
set(_nccl_hints ${FERRY_NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
find_path(FERRY_NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(FERRY_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
if(FERRY_NCCL_INCLUDE_DIR AND FERRY_NCCL_LIBRARY)
  add_library(ferry_nccl INTERFACE IMPORTED GLOBAL)  # one search, one message
  target_include_directories(ferry_nccl INTERFACE ${FERRY_NCCL_INCLUDE_DIR})
  target_link_libraries(ferry_nccl INTERFACE ${FERRY_NCCL_LIBRARY})
  message(STATUS "ferry: NCCL found (${FERRY_NCCL_LIBRARY}): building the data-parallel example and test")
else()
  message(STATUS "ferry: NCCL not found: the data-parallel example and test are not built (set FERRY_NCCL_ROOT)")
endif()
