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
