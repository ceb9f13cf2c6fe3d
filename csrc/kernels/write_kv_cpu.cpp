// Scatter of new tokens' K/V into a contiguous cache on the CPU (see write_kv.h): the rows are checked, all
// of them, before the first byte is written; then each row is one memcpy per head of K and of V (one memcpy
// for all heads when heads are adjacent in both source and cache, as in the per_layer layout with dense
// sources).
#include <omp.h>

#include <cstring>
#include <string>

#include "core/errors.h"
#include "kernels/write_kv.h"

namespace vpaged {
namespace kernels {

namespace {

// Fewest bytes per call worth waking a second thread for (fork/join costs a few microseconds; a memcpy
// moves ~5-10 GB/s per core here, so below this one thread is done before the others start).
constexpr int64_t kParallelBytes = 256 << 10;

[[noreturn]] void fail(const std::string& m) { throw InvalidArgument("write_kv: " + m); }

int v_dim(const WriteKVParams& p) { return p.v_head_dim ? p.v_head_dim : p.head_dim; }

void check_layout(const WriteKVParams& p) {
  if (p.itemsize != 1 && p.itemsize != 2 && p.itemsize != 4 && p.itemsize != 8) fail("itemsize must be 1, 2, 4 or 8");
  if (p.num_rows < 0 || p.num_seqs < 0) fail("negative row or sequence count");
  if (p.num_kv_heads <= 0 || p.head_dim <= 0 || v_dim(p) <= 0) fail("heads and head dims must be positive");
  const int64_t strides[] = {p.k_row_stride, p.k_head_stride, p.v_row_stride,  p.v_head_stride,  p.slot_stride,
                             p.token_stride, p.head_stride,   p.v_slot_stride, p.v_token_stride, p.v_cache_head_stride};
  for (int64_t s : strides) {
    if (s < 0) fail("negative stride");
  }
  if (p.head_stride < p.head_dim || p.v_cache_head_stride < v_dim(p))
    fail("the cache's head stride is smaller than its head dim");
  if (p.extent_lo > p.extent_hi || p.v_extent_lo > p.v_extent_hi) fail("an extent ends before it starts");
  if (p.num_rows == 0) return;
  if (!p.k || !p.v || !p.k_cache || !p.v_cache || !p.slots || !p.lengths || !p.rows || !p.positions)
    fail("null pointer");
}

// Bytes [first, last) one row of K or V writes, relative to the cache base.
void row_span(int64_t slot, int64_t pos, int64_t ss, int64_t ts, int64_t hs, int heads, int dim, int item,
              int64_t* first, int64_t* last) {
  *first = (slot * ss + pos * ts) * item;
  *last = *first + ((heads - 1) * hs + dim) * int64_t(item);
}

template <typename F>
void for_rows(const WriteKVParams& p, int num_threads, F&& f) {
  const int64_t bytes = int64_t(p.num_rows) * p.num_kv_heads * (p.head_dim + v_dim(p)) * int64_t(p.itemsize);
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (threads <= 1 || bytes < kParallelBytes) {
    for (int i = 0; i < p.num_rows; ++i) f(i);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int i = 0; i < p.num_rows; ++i) f(i);
}

// Copy `heads` rows of `dim` elements: one memcpy when the heads are adjacent on both sides.
inline void copy_heads(char* dst, const char* src, int heads, int dim, int64_t dst_hs, int64_t src_hs, int item) {
  const size_t row = size_t(dim) * item;
  if (dst_hs == dim && src_hs == dim) {
    std::memcpy(dst, src, row * heads);
    return;
  }
  for (int h = 0; h < heads; ++h) std::memcpy(dst + h * dst_hs * item, src + h * src_hs * item, row);
}

}  // namespace

void write_kv_check(const WriteKVParams& p) {
  check_layout(p);
  const int vd = v_dim(p);
  const int item = p.itemsize;
  const uintptr_t kb = reinterpret_cast<uintptr_t>(p.k_cache), vb = reinterpret_cast<uintptr_t>(p.v_cache);
  for (int i = 0; i < p.num_rows; ++i) {
    const int32_t r = p.rows[i];
    if (r < 0 || r >= p.num_seqs)
      fail("row " + std::to_string(i) + " names sequence " + std::to_string(r) + " of a descriptor of " +
           std::to_string(p.num_seqs));
    const int32_t pos = p.positions[i];
    const int32_t lo = p.writable_from ? p.writable_from[r] : 0;
    if (pos < lo || pos >= p.lengths[r])
      fail("row " + std::to_string(i) + " writes token " + std::to_string(pos) + " of sequence " + std::to_string(r) +
           ", outside its writable tokens " + std::to_string(lo) + ".." + std::to_string(p.lengths[r] - 1));
    if (p.slots[r] < 0) fail("sequence " + std::to_string(r) + " has a negative slot");
    int64_t first, last;
    bool inside = true;
    if (p.extent_hi != 0) {
      row_span(p.slots[r], pos, p.slot_stride, p.token_stride, p.head_stride, p.num_kv_heads, p.head_dim, item, &first,
               &last);
      inside = kb + first >= p.extent_lo && kb + last <= p.extent_hi;
    }
    if (p.v_extent_hi != 0) {
      row_span(p.slots[r], pos, p.v_slot_stride, p.v_token_stride, p.v_cache_head_stride, p.num_kv_heads, vd, item,
               &first, &last);
      inside = inside && vb + first >= p.v_extent_lo && vb + last <= p.v_extent_hi;
    }
    if (!inside)
      fail("row " + std::to_string(i) + " (slot " + std::to_string(p.slots[r]) + ", token " + std::to_string(pos) +
           ") falls outside the cache's memory");
  }
}

void write_kv_cpu(const WriteKVParams& p, int num_threads) {
  write_kv_check(p);
  const int vd = v_dim(p);
  const int item = p.itemsize;
  const char* ks = static_cast<const char*>(p.k);
  const char* vs = static_cast<const char*>(p.v);
  char* kc = static_cast<char*>(p.k_cache);
  char* vc = static_cast<char*>(p.v_cache);
  for_rows(p, num_threads, [&](int i) {
    const int32_t r = p.rows[i];
    const int64_t slot = p.slots[r], pos = p.positions[i];
    copy_heads(kc + (slot * p.slot_stride + pos * p.token_stride) * item, ks + i * p.k_row_stride * item,
               p.num_kv_heads, p.head_dim, p.head_stride, p.k_head_stride, item);
    copy_heads(vc + (slot * p.v_slot_stride + pos * p.v_token_stride) * item, vs + i * p.v_row_stride * item,
               p.num_kv_heads, vd, p.v_cache_head_stride, p.v_head_stride, item);
  });
}

#ifndef VPAGED_WITH_CUDA
// No CUDA toolkit at build time: the entry point exists but says why it cannot run.
void write_kv_cuda(const WriteKVParams&, int, uintptr_t) {
  throw BackendUnavailable(
      "vpaged was built without CUDA: the CUDA K/V write is not in this build "
      "(rebuild where a CUDA toolkit with bin/nvcc and include/cuda.h is found)");
}
#endif

}  // namespace kernels
}  // namespace vpaged
