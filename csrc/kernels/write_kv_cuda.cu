// Scatter of new tokens' K/V into a contiguous cache on CUDA (see write_kv.h). One thread block per row; its
// threads copy the row's K (heads x head_dim elements) and then its V, element by element (each head's
// elements are adjacent on both sides, so consecutive threads touch consecutive addresses). The host has
// checked every row on host copies of the indices before the launch; the kernel checks the sequence index and
// the position again and skips a row that fails (it cannot raise), so a kernel never writes a token outside
// the tokens a sequence may write, even if the device indices differ from the checked ones.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/errors.h"
#include "kernels/cuda_guard.h"
#include "kernels/write_kv.h"

namespace vpaged {
namespace kernels {

namespace {

constexpr int kThreads = 128;

template <typename T>
__device__ __forceinline__ void copy_row(T* dst, const T* src, int heads, int dim, int64_t dst_hs, int64_t src_hs) {
  const int n = heads * dim;
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const int h = e / dim;
    const int d = e - h * dim;
    dst[h * dst_hs + d] = src[h * src_hs + d];
  }
}

// T: an unsigned integer of the element's size (a copy needs no arithmetic on the values).
template <typename T>
__global__ void write_kv_kernel(const WriteKVParams p) {
  const int64_t i = blockIdx.x;
  const int32_t r = p.rows[i];
  if (r < 0 || r >= p.num_seqs) return;
  const int32_t pos = p.positions[i];
  const int32_t lo = p.writable_from ? p.writable_from[r] : 0;
  const int32_t slot = p.slots[r];
  if (pos < lo || pos >= p.lengths[r] || slot < 0) return;
  const int vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
  copy_row(static_cast<T*>(p.k_cache) + slot * p.slot_stride + int64_t(pos) * p.token_stride,
           static_cast<const T*>(p.k) + i * p.k_row_stride, p.num_kv_heads, p.head_dim, p.head_stride, p.k_head_stride);
  copy_row(static_cast<T*>(p.v_cache) + slot * p.v_slot_stride + int64_t(pos) * p.v_token_stride,
           static_cast<const T*>(p.v) + i * p.v_row_stride, p.num_kv_heads, vd, p.v_cache_head_stride, p.v_head_stride);
}

}  // namespace

void write_kv_cuda(const WriteKVParams& p, int device, uintptr_t stream_handle) {
  if (p.itemsize != 1 && p.itemsize != 2 && p.itemsize != 4 && p.itemsize != 8)
    throw InvalidArgument("write_kv: itemsize must be 1, 2, 4 or 8");
  if (p.num_rows < 0) throw InvalidArgument("write_kv: negative row count");
  if (p.num_rows == 0) return;
  if (!p.k || !p.v || !p.k_cache || !p.v_cache || !p.slots || !p.lengths || !p.rows || !p.positions)
    throw InvalidArgument("write_kv: null pointer");
  DeviceGuard guard(device);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const dim3 grid(static_cast<unsigned>(p.num_rows));
  switch (p.itemsize) {
    case 1:
      write_kv_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(p);
      break;
    case 2:
      write_kv_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(p);
      break;
    case 4:
      write_kv_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      write_kv_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(p);
      break;
  }
  check_cuda(cudaGetLastError(), "write_kv kernel launch");
}

}  // namespace kernels
}  // namespace vpaged
