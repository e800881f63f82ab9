// main() of every `gpu`-labelled GoogleTest binary: exits 77 (CTest's SKIP_RETURN_CODE) when no
// CUDA device can be used, so the suite skips cleanly on CPU-only machines, and says why.
#include <cuda_runtime_api.h>

#include <cstdio>

#include "gtest/gtest.h"

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::fprintf(stderr, "SKIP: no usable CUDA device (%s)\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
