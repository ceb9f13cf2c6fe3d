// Runtime-API helpers shared by the CUDA kernel files (include from .cu files only).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "core/errors.h"

namespace vpaged {
namespace kernels {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw BackendFailure(std::string(what) + ": " + cudaGetErrorString(err));
}

// Kernels launch on the caller's device; our (static) runtime keeps its own current device per thread.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

}  // namespace kernels
}  // namespace vpaged
