// PoolAllocator: memory for torch tensors taken from a PagePool, so that activations, workspaces and
// CUDA-graph memory share one physical budget with the KV caches of the same pool.
//
// Each allocation is its own virtual range of whole pages (the size rounded up to the page size), all of
// it mapped from the pool at once: all or nothing. Freeing waits for the device's queued work, unmaps
// and gives the pages back, so the next KV page or allocation can take them. A free while a CUDA graph is
// being captured cannot wait (the driver forbids it): it is deferred, the pages staying mapped and held,
// and completed by the first call after the capture (see torch_allocator.cpp). There is no caching here:
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
  size_t segments;        // live allocations
  size_t bytes;           // their requested sizes, summed (what torch counts as reserved)
  size_t mapped_bytes;    // their pages and those of deferred frees, summed (bytes rounded up to pages)
  size_t peak_bytes;      // highest `bytes` since creation
  size_t mallocs;         // successful allocations
  size_t frees;           // successful frees
  size_t failures;        // allocations refused (cap, out of pages, driver failure)
  size_t bad_frees;       // frees of unknown or already freed pointers, or that failed
  size_t max_bytes;       // cap on `bytes` (0: none)
  size_t deferred_frees;  // freed during a CUDA graph capture, not yet unmapped: their pages are still
                          // mapped (in mapped_bytes) and held, and count against the cap; not in segments
};

class PoolAllocator {
 public:
  // max_bytes: cap on the requested bytes alive at once (0: only the pool's capacity limits).
  PoolAllocator(std::shared_ptr<PagePool> pool, size_t max_bytes);
  ~PoolAllocator();
  PoolAllocator(const PoolAllocator&) = delete;
  PoolAllocator& operator=(const PoolAllocator&) = delete;

  // A page-aligned range of at least `size` bytes, mapped. Throws InvalidArgument (size 0), OutOfPages
  // (cap or pool exhausted), MappingLimit or BackendFailure; nothing changes when it throws. Completes
  // deferred frees first where it can (flush_deferred(stream)). `stream`: the one torch allocates on.
  void* allocate(size_t size, uintptr_t stream = 0);
  // Waits for the device's queued work, unmaps, returns the pages. `size` (0: not checked) must be the
  // size given to allocate; `stream` is the one torch passes (0: the legacy stream). An unknown or already
  // freed pointer throws InvalidArgument and is counted; a failed wait or unmap throws and keeps the
  // allocation (it may be freed again later). While a CUDA graph is being captured (on `stream`, on a
  // stream an earlier deferred free saw capturing, or wherever the device-wide wait says so) the free is
  // deferred instead: it returns, the pointer counts as freed, the pages stay mapped until a later call.
  void deallocate(void* ptr, size_t size = 0, uintptr_t stream = 0);
  // Complete the deferred frees, unless a capture is known to run (asked of `stream` and of the streams
  // deferred frees saw capturing, without disturbing any capture). Never throws; returns how many are
  // still deferred. allocate, deallocate and the stats entry points call it first.
  size_t flush_deferred(uintptr_t stream = 0) noexcept;
  size_t deferred_frees() const;
  bool idle() const;                     // no live and no deferred allocations
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
  // After unmapping: the pages back to the pool, the counters, the reservation released (never throws).
  void finish_free(uintptr_t va, const Allocation& a) noexcept;
  // Whether a capture runs: on `stream` (remembered), a capture the legacy stream reports, or on a stream
  // remembered earlier (forgotten once it no longer captures).
  bool capture_running(uintptr_t stream);

  std::shared_ptr<PagePool> pool_;
  size_t page_size_;
  size_t max_bytes_;
  mutable std::mutex mu_;  // guards everything below; never held across a backend call
  std::unordered_map<uintptr_t, Allocation> live_;
  std::vector<std::pair<uintptr_t, Allocation>> deferred_;  // freed during a capture, still mapped
  std::vector<uintptr_t> capture_streams_;                  // streams a deferred free saw capturing
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
  uint64_t deferred_frees;
} vpaged_torch_stats_t;

__attribute__((visibility("default"))) void* vpaged_torch_malloc(size_t size, int device, void* stream) noexcept;
__attribute__((visibility("default"))) void vpaged_torch_free(void* ptr, size_t size, int device,
                                                              void* stream) noexcept;
// 0 and *out filled when an allocator is bound to `device`; -1 (reason in last error) otherwise. Completes
// deferred frees first where it can.
__attribute__((visibility("default"))) int vpaged_torch_stats(int device, vpaged_torch_stats_t* out) noexcept;
// Complete the deferred frees of `device`'s allocators (bound and unbound) where no capture is known to run:
// how many are still deferred (>= 0).
__attribute__((visibility("default"))) int64_t vpaged_torch_flush(int device) noexcept;
// Why this thread's last vpaged_torch_* call failed; "" when it succeeded. Valid until the next call.
__attribute__((visibility("default"))) const char* vpaged_torch_last_error() noexcept;
}
