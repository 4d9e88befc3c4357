# The GPU test and benchmark (tests/gpu/), included from kernels/cuda.cmake when CUDA builds.
# Both are plain C programs over the CUDA runtime's C API; without a GPU they exit 77, which
# ctest reports as skipped, so the CPU suite never depends on a GPU.

add_library(embd_gpu_util STATIC ${PROJECT_SOURCE_DIR}/tests/gpu/gpu_util.c)
target_link_libraries(embd_gpu_util PUBLIC embd_kernels_cuda)

add_executable(test_cuda_kernels
  ${PROJECT_SOURCE_DIR}/tests/gpu/test_cuda_kernels.c
  ${PROJECT_SOURCE_DIR}/tests/gpu/test_cuda_bucketize.c
  ${PROJECT_SOURCE_DIR}/tests/gpu/test_cuda_helpers.c)
target_link_libraries(test_cuda_kernels PRIVATE embd_gpu_util m)
add_test(NAME test_cuda_kernels COMMAND test_cuda_kernels)
set_tests_properties(test_cuda_kernels PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 LABELS gpu)

add_executable(bench_cuda_kernels ${PROJECT_SOURCE_DIR}/tests/gpu/bench_cuda_kernels.c)
target_link_libraries(bench_cuda_kernels PRIVATE embd_gpu_util)

# The NCCL engine of dist/comm.h on one GPU (world of 1, and a missing peer timing out).
# Built from its sources here, without Gloo or cJSON, so the kernels-only configuration of a
# lent GPU machine builds it too.
find_library(EMBD_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
if(EMBD_NCCL_LIBRARY)
  add_executable(test_comm_nccl
    ${PROJECT_SOURCE_DIR}/tests/gpu/test_comm_nccl.c
    ${PROJECT_SOURCE_DIR}/dist/store.c
    ${PROJECT_SOURCE_DIR}/dist/store_server.c
    ${PROJECT_SOURCE_DIR}/dist/comm.c
    ${PROJECT_SOURCE_DIR}/dist/comm_nccl.c)
  target_include_directories(test_comm_nccl PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/include)
  target_compile_definitions(test_comm_nccl PRIVATE EMBD_HAVE_NCCL)
  target_link_libraries(test_comm_nccl PRIVATE CUDA::cudart ${EMBD_NCCL_LIBRARY} Threads::Threads)
  add_test(NAME test_comm_nccl COMMAND test_comm_nccl)
  set_tests_properties(test_comm_nccl PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 120 LABELS gpu)
endif()
