# embd_kernels_cuda: the embedding kernels for GPU memory (kernels/embedding_cuda.h), built
# whenever nvcc exists (EMBD_HAVE_CUDA) and run only where a GPU is (tests/gpu/run.sh).
#
# --fmad=false: nvcc would otherwise contract a*b+c into one FMA where the CPU kernels (built
# with -ffp-contract=off) round twice; the per-row headers spell out every FMA they mean, so
# with contraction off both sides round alike and the GPU matches the CPU bit for bit.

if(NOT EMBD_HAVE_CUDA)
  return()
endif()

add_library(embd_kernels_cuda STATIC
  cuda_backward.cu
  cuda_bucketize.cu
  cuda_cache.cu
  cuda_ctx.cu
  cuda_forward.cu
)
target_include_directories(embd_kernels_cuda PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/include)
target_link_libraries(embd_kernels_cuda PUBLIC embd_kernels CUDA::cudart)
set_target_properties(embd_kernels_cuda PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)

# nvcc has no -Wall/-Wextra of its own (the top level adds them for C and C++ only): hand them
# to the host compiler, and have nvcc's own warnings fail the build too under EMBD_WERROR.
target_compile_options(embd_kernels_cuda PRIVATE
  --fmad=false
  -Xcompiler=-Wall,-Wextra
  $<$<BOOL:${EMBD_WERROR}>:--Werror=all-warnings>
  $<$<BOOL:${EMBD_WERROR}>:-Xcompiler=-Werror>)

include(${PROJECT_SOURCE_DIR}/tests/gpu/gpu.cmake)
