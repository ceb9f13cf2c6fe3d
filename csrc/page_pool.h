// PagePool: the physical pages of one backend (one device, one page size), with a capacity, a free
// list and reference counts. A page is "used" while its count is above zero; ranges that map it hold
// the references. Thread-safe: every public call takes the pool's mutex.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "backend.h"

namespace vpaged {

// Who took a page from the pool, so one budget can be read by owner. Set when the page is acquired and
// kept while it is used (a KV page shared into other ranges still counts once, for its first owner).
enum class PageOwner : uint8_t { kKVCache = 0, kAllocator = 1 };
constexpr size_t kPageOwners = 2;

struct PoolStats {
  size_t page_size;
  size_t total_pages;
  size_t used_pages;
  size_t free_pages;
  size_t high_water_pages;
  size_t created_pages;
  size_t kv_pages;         // used pages owned by KV caches (ranges, copy-on-write)
  size_t allocator_pages;  // used pages owned by the torch allocator hook and vpaged.empty
};

class PagePool {
 public:
  // reserve_pages: physical pages created at construction (the rest in batches as needed).
  PagePool(std::shared_ptr<Backend> backend, size_t reserve_pages = 0, size_t create_batch = 64);

  Backend& backend() { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const { return backend_; }
  size_t page_size() const { return backend_->page_size(); }

  // n fresh pages, each with reference count 1 owned by the caller. All or nothing: throws OutOfPages
  // and changes nothing when fewer than n are free.
  std::vector<PageId> acquire(size_t n, PageOwner owner = PageOwner::kKVCache);
  void incref(PageId page);
  void incref_all(const std::vector<PageId>& pages);
  // Drops one reference; a page whose count reaches zero goes back on the free list.
  void decref(PageId page);
  void decref_all(const std::vector<PageId>& pages);
  int32_t refcount(PageId page) const;
  size_t free_pages() const;
  PoolStats stats() const;
  // Give the RAM of every free page back to the system (where the backend can).
  size_t trim();
  void reset_high_water();

 private:
  void check(PageId page) const;
  void grow_locked(size_t needed);

  std::shared_ptr<Backend> backend_;
  size_t create_batch_;
  mutable std::mutex mu_;
  std::vector<int32_t> refcount_;
  std::vector<PageOwner> owner_;  // valid while the page is used
  size_t owned_[kPageOwners] = {};
  std::vector<PageId> free_;  // a stack: the most recently freed page is reused first (warm memory)
  size_t used_ = 0;
  size_t high_water_ = 0;
};

}  // namespace vpaged
