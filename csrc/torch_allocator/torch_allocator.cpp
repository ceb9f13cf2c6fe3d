// PoolAllocator and the C entry points torch's CUDAPluggableAllocator calls (see torch_allocator.h).
//
// Note on the order of a free. cuMemUnmap does not wait for kernels that still use the memory, and the
// stream torch passes to free is only the one the segment was allocated on: a tensor of the segment may
// have been used on any other stream since (record_stream, or side streams the caching allocator tracks
// with events it has already retired). cudaFree, which torch's own segments go through, synchronizes the
// whole device. So does this free: the device's queued work completes first (synchronize_device), then
// the range is unmapped, then its pages go back to the pool, where a KV cache may hand them out at once.
// This costs a device sync per free, which is why the hook is meant for a MemPool scope (segments are
// freed only at scope exit or empty_cache), not as the process-wide allocator.
//
// Frees during a CUDA graph capture. While any stream of the context captures, cuCtxSynchronize is refused
// (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and, in the global capture mode torch.cuda.graph uses by default,
// the refused call invalidates the capture. Such a free is deferred rather than failed: the allocation
// leaves live_ (torch has freed it: a second free of the pointer is still refused), its pages stay mapped
// and held by the allocator (a replay or kernel still queued may use them), and stats().deferred_frees
// counts it. A capture is detected without waiting where possible: the stream torch passes to free is asked
// (cuStreamIsCapturing), so is the legacy stream, and so are the streams earlier deferred frees saw
// capturing; only when none of these says so is the wait tried, and a capture error from it defers too.
// Every later allocate, deallocate and stats call, and vpaged_torch_flush, first retries the deferred frees
// (one wait for all of them); they complete once no known capture runs. A capture on a stream vpaged never
// saw shows only as the wait's error, so until the deferred frees complete each retry costs a refused wait.
//
// Lock order: the registry's mutex, then an allocator's, then the pool's (inside acquire / decref). No
// lock is held across a backend call except the pool's own, and no call takes the GIL.
#include "torch_allocator/torch_allocator.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <map>
#include <string>

#include "core/errors.h"

namespace vpaged {

PoolAllocator::PoolAllocator(std::shared_ptr<PagePool> pool, size_t max_bytes)
    : pool_(std::move(pool)), page_size_(pool_ ? pool_->page_size() : 0), max_bytes_(max_bytes) {
  if (!pool_) throw InvalidArgument("a pool allocator needs a pool");
}

PoolAllocator::~PoolAllocator() {
  // Only reached with live allocations when their owners are gone too (process exit, or a DLPack tensor
  // freed through another path), or with deferred frees that no later call completed: give the pages back
  // as a free would.
  for (auto& [va, a] : deferred_) live_.emplace(va, std::move(a));
  for (auto& [va, a] : live_) {
    try {
      pool_->backend().synchronize_device();
      unmap_and_release(va, a);
    } catch (...) {
    }
  }
}

bool PoolAllocator::capture_running(uintptr_t stream) {
  Backend& backend = pool_->backend();
  bool running = false;
  if (stream != 0 && backend.capturing(stream)) {
    running = true;
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(capture_streams_.begin(), capture_streams_.end(), stream) == capture_streams_.end()) {
      capture_streams_.push_back(stream);
    }
  }
  if (!running && backend.capturing(0)) running = true;
  std::vector<uintptr_t> known;
  {
    std::lock_guard<std::mutex> lock(mu_);
    known = capture_streams_;
  }
  std::vector<uintptr_t> ended;
  for (uintptr_t s : known) {
    if (s == stream && running) continue;
    if (backend.capturing(s)) {
      running = true;
    } else {
      ended.push_back(s);
    }
  }
  if (!ended.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& c = capture_streams_;
    c.erase(std::remove_if(c.begin(), c.end(),
                           [&](uintptr_t s) { return std::find(ended.begin(), ended.end(), s) != ended.end(); }),
            c.end());
  }
  return running;
}

size_t PoolAllocator::flush_deferred(uintptr_t stream) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (deferred_.empty()) return 0;
  }
  std::vector<std::pair<uintptr_t, Allocation>> batch;
  size_t done = 0;
  try {
    if (!capture_running(stream)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        batch.swap(deferred_);
      }
      if (!batch.empty()) {
        pool_->backend().synchronize_device();  // one wait for all; throws (CaptureActive) while a capture runs
        for (; done < batch.size(); ++done) {
          pool_->backend().unmap(batch[done].first, batch[done].second.pages);
          finish_free(batch[done].first, batch[done].second);
        }
      }
    }
  } catch (...) {
    // Still deferred (a capture runs, or the wait or an unmap failed): a later call tries again.
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = done; i < batch.size(); ++i) deferred_.push_back(std::move(batch[i]));
  return deferred_.size();
}

size_t PoolAllocator::deferred_frees() const {
  std::lock_guard<std::mutex> lock(mu_);
  return deferred_.size();
}

bool PoolAllocator::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.empty() && deferred_.empty();
}

void* PoolAllocator::allocate(size_t size, uintptr_t stream) {
  if (size == 0) throw InvalidArgument("allocation of 0 bytes");
  flush_deferred(stream);  // their pages may be what this allocation needs
  if (size > std::numeric_limits<size_t>::max() - page_size_) {
    throw InvalidArgument("allocation of " + std::to_string(size) + " bytes is too large");
  }
  const size_t pages = (size + page_size_ - 1) / page_size_;
  {
    // Claim the bytes under the cap first, so that two threads cannot both pass it.
    std::lock_guard<std::mutex> lock(mu_);
    if (max_bytes_ != 0 && (size > max_bytes_ || bytes_ > max_bytes_ - size)) {
      ++failures_;
      throw OutOfPages("allocation of " + std::to_string(size) + " bytes would exceed the allocator's cap of " +
                       std::to_string(max_bytes_) + " bytes (" + std::to_string(bytes_) + " in use)");
    }
    bytes_ += size;
  }
  auto give_back_claim = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_ -= size;
    ++failures_;
  };
  Backend& backend = pool_->backend();
  uintptr_t va = 0;
  std::vector<PageId> ids;
  try {
    va = backend.reserve(pages * page_size_);
    try {
      ids = pool_->acquire(pages, PageOwner::kAllocator);
      try {
        backend.map(va, ids.data(), ids.size());  // all or nothing
      } catch (...) {
        for (PageId p : ids) pool_->decref(p);
        throw;
      }
    } catch (...) {
      try {
        backend.release(va, pages * page_size_);
      } catch (...) {
      }
      throw;
    }
  } catch (...) {
    give_back_claim();
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  live_.emplace(va, Allocation{size, pages, std::move(ids)});
  mapped_bytes_ += pages * page_size_;
  peak_bytes_ = std::max(peak_bytes_, bytes_);
  ++mallocs_;
  return reinterpret_cast<void*>(va);
}

void PoolAllocator::unmap_and_release(uintptr_t va, const Allocation& a) {
  Backend& backend = pool_->backend();
  backend.unmap(va, a.pages);
  for (PageId p : a.page_ids) pool_->decref(p);
  // The pages are back whatever happens now; a failed release leaks address space only.
  backend.release(va, a.pages * page_size_);
}

void PoolAllocator::finish_free(uintptr_t va, const Allocation& a) noexcept {
  for (PageId p : a.page_ids) {
    try {
      pool_->decref(p);
    } catch (...) {
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_ -= a.size;
    mapped_bytes_ -= a.pages * page_size_;
    ++frees_;
  }
  try {
    pool_->backend().release(va, a.pages * page_size_);  // the pages are back; only address space could leak
  } catch (...) {
  }
}

void PoolAllocator::deallocate(void* ptr, size_t size, uintptr_t stream) {
  flush_deferred(stream);
  const uintptr_t va = reinterpret_cast<uintptr_t>(ptr);
  Allocation a;
  {
    // Taken out of live_ before the slow part, so a concurrent second free of the pointer is refused.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(va);
    if (it == live_.end()) {
      ++bad_frees_;
      throw InvalidArgument("free of an unknown or already freed pointer " + std::to_string(va));
    }
    if (size != 0 && size != it->second.size) {
      ++bad_frees_;
      throw InvalidArgument("free of pointer " + std::to_string(va) + " with size " + std::to_string(size) +
                            ", allocated with size " + std::to_string(it->second.size) + "; not freed");
    }
    a = std::move(it->second);
    live_.erase(it);
  }
  auto put_back = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    ++bad_frees_;
    live_.emplace(va, std::move(a));
  };
  // See the note at the top of the file: nothing may still use the pages when they are unmapped, and a
  // capture forbids the wait (the free is deferred then).
  bool defer = false;
  try {
    defer = capture_running(stream);
    if (!defer) {
      try {
        pool_->backend().synchronize_device();
      } catch (const CaptureActive&) {
        defer = true;
      }
    }
    if (!defer) pool_->backend().unmap(va, a.pages);
  } catch (...) {
    put_back();  // still mapped, pages still held: a later free can retry
    throw;
  }
  if (defer) {
    std::lock_guard<std::mutex> lock(mu_);
    deferred_.emplace_back(va, std::move(a));  // bytes_ and mapped_bytes_ keep counting it until it completes
    return;
  }
  finish_free(va, a);
}

bool PoolAllocator::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.count(reinterpret_cast<uintptr_t>(ptr)) != 0;
}

bool PoolAllocator::contains(const void* ptr) const {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [va, a] : live_)
    if (p >= va && p - va < a.pages * page_size_) return true;
  return false;
}

size_t PoolAllocator::live_segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

void PoolAllocator::count_bad_free() {
  std::lock_guard<std::mutex> lock(mu_);
  ++bad_frees_;
}

AllocatorStats PoolAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t requested = 0;
  for (const auto& kv : live_) requested += kv.second.size;
  return AllocatorStats{page_size_, live_.size(), requested,  mapped_bytes_, peak_bytes_,     mallocs_,
                        frees_,     failures_,    bad_frees_, max_bytes_,    deferred_.size()};
}

// ---------------------------------------------------------------------------------------------------
// Per-device binding.

namespace {

struct DeviceEntry {
  std::shared_ptr<PoolAllocator> current;               // takes new allocations
  std::vector<std::shared_ptr<PoolAllocator>> retired;  // unbound, still holding live allocations
};

struct Registry {
  std::mutex mu;
  std::map<int, DeviceEntry> devices;
};

// Never destroyed: torch may free segments while the process exits, after static destructors ran.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

void prune_locked(DeviceEntry& entry) {
  auto& r = entry.retired;
  r.erase(std::remove_if(r.begin(), r.end(), [](const auto& a) { return a->idle(); }), r.end());
}

// Allocators of `device` that may own a pointer: the bound one first, then retired ones.
std::vector<std::shared_ptr<PoolAllocator>> candidates(int device) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<std::shared_ptr<PoolAllocator>> out;
  auto it = reg.devices.find(device);
  if (it == reg.devices.end()) return out;
  if (it->second.current) out.push_back(it->second.current);
  out.insert(out.end(), it->second.retired.begin(), it->second.retired.end());
  return out;
}

}  // namespace

void bind_device_allocator(int device, std::shared_ptr<PoolAllocator> allocator) {
  if (!allocator) throw InvalidArgument("bind: no allocator");
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  DeviceEntry& entry = reg.devices[device];
  if (entry.current == allocator) return;
  if (entry.current) {
    throw InvalidArgument("device " + std::to_string(device) +
                          " already has a vpaged torch allocator bound; close that one first");
  }
  entry.retired.erase(std::remove(entry.retired.begin(), entry.retired.end(), allocator), entry.retired.end());
  entry.current = std::move(allocator);
}

void unbind_device_allocator(int device, const PoolAllocator* allocator) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.devices.find(device);
  if (it == reg.devices.end() || !it->second.current || it->second.current.get() != allocator) return;
  it->second.retired.push_back(std::move(it->second.current));
  it->second.current.reset();
  prune_locked(it->second);
}

std::shared_ptr<PoolAllocator> device_allocator(int device) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.devices.find(device);
  return it == reg.devices.end() ? nullptr : it->second.current;
}

}  // namespace vpaged

// ---------------------------------------------------------------------------------------------------
// C entry points.

namespace {

thread_local std::string last_error;

void set_error(const std::string& what) noexcept {
  try {
    last_error = what;
  } catch (...) {
    // No memory for the message: leave the previous one rather than throw out of a noexcept function.
  }
}

std::string no_allocator_reason(int device) {
  if (device >= 0 && !vpaged::built_with_cuda()) {
    return "vpaged was built without CUDA: no pool can serve CUDA device " + std::to_string(device);
  }
  return "no vpaged pool is bound to device " + std::to_string(device) +
         " (vpaged.torch_allocator binds one; -1 is the host pool)";
}

}  // namespace

extern "C" {

// The stream only serves to notice a graph capture: mapping is not stream-ordered.
void* vpaged_torch_malloc(size_t size, int device, void* stream) noexcept {
  last_error.clear();
  try {
    std::shared_ptr<vpaged::PoolAllocator> a = vpaged::device_allocator(device);
    if (!a) {
      set_error(no_allocator_reason(device));
      return nullptr;
    }
    return a->allocate(size, reinterpret_cast<uintptr_t>(stream));
  } catch (const std::exception& e) {
    set_error(std::string("vpaged_torch_malloc(") + std::to_string(size) + " bytes, device " + std::to_string(device) +
              "): " + e.what());
  } catch (...) {
    set_error("vpaged_torch_malloc: unknown error");
  }
  return nullptr;
}

// The whole device is waited for; the stream serves to notice a graph capture without waiting.
void vpaged_torch_free(void* ptr, size_t size, int device, void* stream) noexcept {
  last_error.clear();
  try {
    if (ptr == nullptr) return;  // as free(NULL)
    const uintptr_t s = reinterpret_cast<uintptr_t>(stream);
    auto all = vpaged::candidates(device);
    for (const auto& a : all) {
      if (!a->owns(ptr)) {
        a->flush_deferred(s);
        continue;
      }
      a->deallocate(ptr, size, s);  // throws on a concurrent double free or a failed wait / unmap
      return;
    }
    if (!all.empty()) all.front()->count_bad_free();
    set_error("vpaged_torch_free: pointer " + std::to_string(reinterpret_cast<uintptr_t>(ptr)) +
              " was not allocated by vpaged on device " + std::to_string(device) + " or was freed already");
  } catch (const std::exception& e) {
    set_error(std::string("vpaged_torch_free: ") + e.what());
  } catch (...) {
    set_error("vpaged_torch_free: unknown error");
  }
}

int vpaged_torch_stats(int device, vpaged_torch_stats_t* out) noexcept {
  last_error.clear();
  try {
    if (out == nullptr) {
      set_error("vpaged_torch_stats: out is NULL");
      return -1;
    }
    std::shared_ptr<vpaged::PoolAllocator> a = vpaged::device_allocator(device);
    if (!a) {
      set_error(no_allocator_reason(device));
      return -1;
    }
    a->flush_deferred();
    const vpaged::AllocatorStats s = a->stats();
    *out = vpaged_torch_stats_t{s.page_size, s.segments, s.bytes,     s.mapped_bytes, s.peak_bytes,    s.mallocs,
                                s.frees,     s.failures, s.bad_frees, s.max_bytes,    s.deferred_frees};
    return 0;
  } catch (const std::exception& e) {
    set_error(std::string("vpaged_torch_stats: ") + e.what());
  } catch (...) {
    set_error("vpaged_torch_stats: unknown error");
  }
  return -1;
}

int64_t vpaged_torch_flush(int device) noexcept {
  last_error.clear();
  try {
    size_t left = 0;
    for (const auto& a : vpaged::candidates(device)) left += a->flush_deferred();
    return static_cast<int64_t>(left);
  } catch (const std::exception& e) {
    set_error(std::string("vpaged_torch_flush: ") + e.what());
  } catch (...) {
    set_error("vpaged_torch_flush: unknown error");
  }
  return 0;
}

const char* vpaged_torch_last_error() noexcept { return last_error.c_str(); }

}  // extern "C"
