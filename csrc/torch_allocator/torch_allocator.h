// PoolAllocator: memory for torch tensors taken from a PagePool, so that activations, workspaces and
// CUDA-graph memory share one physical budget with the KV caches of the same pool.
//
// Each allocation is its own virtual range of whole pages (the size rounded up to the page size), all of
// it mapped from the pool at once: all or nothing. Freeing waits for the device's queued work, unmaps
// and gives the pages back, so the next KV page or allocation can take them. There is no caching here:
// torch's caching allocator (one torch.cuda.MemPool per scope) already keeps and splits segments; what
// vpaged adds is that a segment's pages come from, and return to, the shared pool.
//
// The C entry points below (torch's CUDAPluggableAllocator signatures) route by device to the allocator
// bound to it: -1 is the host pool (vpaged.empty and tests use that path on any machine).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/page_pool.h"

namespace vpaged {

struct AllocatorStats {
  size_t page_size;
  size_t segments;      // live allocations
  size_t bytes;         // their requested sizes, summed (what torch counts as reserved)
  size_t mapped_bytes;  // their pages, summed (bytes rounded up to pages)
  size_t peak_bytes;    // highest `bytes` since creation
  size_t mallocs;       // successful allocations
  size_t frees;         // successful frees
  size_t failures;      // allocations refused (cap, out of pages, driver failure)
  size_t bad_frees;     // frees of unknown or already freed pointers, or that failed
  size_t max_bytes;     // cap on `bytes` (0: none)
};

class PoolAllocator {
 public:
  // max_bytes: cap on the requested bytes alive at once (0: only the pool's capacity limits).
  PoolAllocator(std::shared_ptr<PagePool> pool, size_t max_bytes);
  ~PoolAllocator();
  PoolAllocator(const PoolAllocator&) = delete;
  PoolAllocator& operator=(const PoolAllocator&) = delete;

  // A page-aligned range of at least `size` bytes, mapped. Throws InvalidArgument (size 0), OutOfPages
  // (cap or pool exhausted), MappingLimit or BackendFailure; nothing changes when it throws.
  void* allocate(size_t size);
  // Waits for the device's queued work, unmaps, returns the pages. `size` (0: not checked) must be the
  // size given to allocate. An unknown or already freed pointer throws InvalidArgument and is counted;
  // a failed wait or unmap throws and keeps the allocation (it may be freed again later).
  void deallocate(void* ptr, size_t size = 0);
  bool owns(const void* ptr) const;      // ptr is the start of a live allocation
  bool contains(const void* ptr) const;  // ptr lies inside a live allocation
  AllocatorStats stats() const;
  size_t live_segments() const;
  const std::shared_ptr<PagePool>& pool() const { return pool_; }
  size_t max_bytes() const { return max_bytes_; }
  void count_bad_free();

 private:
  struct Allocation {
    size_t size;   // requested
    size_t pages;  // mapped, from va
    std::vector<PageId> page_ids;
  };
  // Unmap, return pages, release the reservation. The caller has removed `a` from live_ and waited.
  void unmap_and_release(uintptr_t va, const Allocation& a);

  std::shared_ptr<PagePool> pool_;
  size_t page_size_;
  size_t max_bytes_;
  mutable std::mutex mu_;  // guards everything below; never held across a backend call
  std::unordered_map<uintptr_t, Allocation> live_;
  size_t bytes_ = 0;  // requested bytes of live allocations plus those being mapped right now
  size_t mapped_bytes_ = 0;
  size_t peak_bytes_ = 0;
  size_t mallocs_ = 0;
  size_t frees_ = 0;
  size_t failures_ = 0;
  size_t bad_frees_ = 0;
};

// The allocator the C entry points use for `device` (-1: host). Binding a second, different allocator
// to a device that has one throws InvalidArgument; unbinding stops new allocations on the device, while
// frees of its live allocations still find it (torch may free segments long after).
void bind_device_allocator(int device, std::shared_ptr<PoolAllocator> allocator);
void unbind_device_allocator(int device, const PoolAllocator* allocator);
std::shared_ptr<PoolAllocator> device_allocator(int device);

}  // namespace vpaged

// C entry points for torch.cuda.memory.CUDAPluggableAllocator (and ctypes). No Python, no GIL, never
// throw. Failures return NULL / nothing and leave the reason in vpaged_torch_last_error().
extern "C" {

typedef struct vpaged_torch_stats_t {
  uint64_t page_size, segments, bytes, mapped_bytes, peak_bytes, mallocs, frees, failures, bad_frees, max_bytes;
} vpaged_torch_stats_t;

__attribute__((visibility("default"))) void* vpaged_torch_malloc(size_t size, int device, void* stream) noexcept;
__attribute__((visibility("default"))) void vpaged_torch_free(void* ptr, size_t size, int device,
                                                              void* stream) noexcept;
// 0 and *out filled when an allocator is bound to `device`; -1 (reason in last error) otherwise.
__attribute__((visibility("default"))) int vpaged_torch_stats(int device, vpaged_torch_stats_t* out) noexcept;
// Why this thread's last vpaged_torch_* call failed; "" when it succeeded. Valid until the next call.
__attribute__((visibility("default"))) const char* vpaged_torch_last_error() noexcept;
}
