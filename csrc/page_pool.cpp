#include "page_pool.h"

#include <algorithm>
#include <string>

#include "errors.h"

namespace vpaged {

PagePool::PagePool(std::shared_ptr<Backend> backend, size_t reserve_pages, size_t create_batch)
    : backend_(std::move(backend)), create_batch_(std::max<size_t>(create_batch, 1)) {
  std::lock_guard<std::mutex> lock(mu_);
  grow_locked(std::min(reserve_pages, backend_->capacity_pages()));
}

// Take in the pages the backend has created (all of them for the host backend), then, if fewer than
// `needed` are free, create more in batches, bounded by capacity.
void PagePool::grow_locked(size_t needed) {
  auto absorb = [this] {
    const size_t now = backend_->created_pages();
    if (now > refcount_.size()) {
      const size_t old = refcount_.size();
      refcount_.resize(now, 0);
      owner_.resize(now, PageOwner::kKVCache);
      // Freshly created pages go under the pages already free, in reverse, so that among them low ids
      // are handed out first (a run of consecutive ids maps in one host call).
      free_.insert(free_.begin(), now - old, 0);
      for (size_t i = 0; i < now - old; ++i) free_[i] = static_cast<PageId>(now - 1 - i);
    }
  };
  absorb();
  const size_t cap = backend_->capacity_pages();
  const size_t created = backend_->created_pages();
  if (free_.size() < needed && created < cap) {
    const size_t want = std::max(needed - free_.size(), create_batch_);
    backend_->create_pages(std::min(want, cap - created));
    absorb();
  }
}

std::vector<PageId> PagePool::acquire(size_t n, PageOwner owner) {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < n) grow_locked(n);
  if (free_.size() < n) {
    throw OutOfPages("page pool exhausted: " + std::to_string(n) + " page(s) of " +
                     std::to_string(backend_->page_size()) + " bytes requested, " +
                     std::to_string(free_.size()) + " free of " +
                     std::to_string(backend_->capacity_pages()));
  }
  std::vector<PageId> out(free_.end() - static_cast<ptrdiff_t>(n), free_.end());
  std::reverse(out.begin(), out.end());
  free_.resize(free_.size() - n);
  for (PageId p : out) {
    refcount_[p] = 1;
    owner_[p] = owner;
  }
  owned_[static_cast<size_t>(owner)] += n;
  used_ += n;
  high_water_ = std::max(high_water_, used_);
  return out;
}

void PagePool::check(PageId page) const {
  if (page < 0 || static_cast<size_t>(page) >= refcount_.size()) {
    throw InvalidArgument("page id " + std::to_string(page) + " does not exist in this pool");
  }
}

void PagePool::incref(PageId page) {
  std::lock_guard<std::mutex> lock(mu_);
  check(page);
  if (refcount_[page] <= 0) throw InvalidArgument("incref of free page " + std::to_string(page));
  ++refcount_[page];
}

void PagePool::incref_all(const std::vector<PageId>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  for (PageId p : pages) {
    check(p);
    if (refcount_[p] <= 0) throw InvalidArgument("incref of free page " + std::to_string(p));
  }
  for (PageId p : pages) ++refcount_[p];
}

void PagePool::decref(PageId page) {
  std::lock_guard<std::mutex> lock(mu_);
  check(page);
  if (refcount_[page] <= 0) throw InvalidArgument("decref of free page " + std::to_string(page));
  if (--refcount_[page] == 0) {
    free_.push_back(page);
    --used_;
    --owned_[static_cast<size_t>(owner_[page])];
  }
}

void PagePool::decref_all(const std::vector<PageId>& pages) {
  for (PageId p : pages) decref(p);
}

int32_t PagePool::refcount(PageId page) const {
  std::lock_guard<std::mutex> lock(mu_);
  check(page);
  return refcount_[page];
}

size_t PagePool::free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return backend_->capacity_pages() - used_;
}

PoolStats PagePool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t total = backend_->capacity_pages();
  return PoolStats{backend_->page_size(), total, used_, total - used_, high_water_,
                   backend_->created_pages(), owned_[static_cast<size_t>(PageOwner::kKVCache)],
                   owned_[static_cast<size_t>(PageOwner::kAllocator)]};
}

size_t PagePool::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  for (PageId p : free_) backend_->discard_page(p);
  return free_.size();
}

void PagePool::reset_high_water() {
  std::lock_guard<std::mutex> lock(mu_);
  high_water_ = used_;
}

}  // namespace vpaged
