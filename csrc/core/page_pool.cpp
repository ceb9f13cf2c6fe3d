#include "core/page_pool.h"

#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/errors.h"

namespace vpaged {

namespace {
// The process-wide capture flag and the pools with something deferred (drained by the last end_capture).
std::atomic<int> capture_depth{0};
std::mutex deferred_pools_mu;
std::vector<std::weak_ptr<PagePool>> deferred_pools;
}  // namespace

void PagePool::begin_capture() { capture_depth.fetch_add(1, std::memory_order_acq_rel); }

void PagePool::end_capture() {
  int depth = capture_depth.load(std::memory_order_acquire);
  do {
    if (depth <= 0) return;  // unbalanced: nothing raised it
  } while (!capture_depth.compare_exchange_weak(depth, depth - 1, std::memory_order_acq_rel));
  if (depth != 1) return;
  std::vector<std::weak_ptr<PagePool>> pools;
  {
    std::lock_guard<std::mutex> lock(deferred_pools_mu);
    pools.swap(deferred_pools);
  }
  // A pool that still cannot release (another capture began, the device refused) lists itself again.
  for (auto& weak : pools)
    if (auto pool = weak.lock()) pool->release_deferred();
}

bool PagePool::capture_flagged() { return capture_depth.load(std::memory_order_acquire) > 0; }

bool PagePool::capture_running() const {
  return backend_->mapping_breaks_capture() && (capture_flagged() || backend_->capturing(0));
}

PagePool::PagePool(std::shared_ptr<Backend> backend, size_t reserve_pages, size_t create_batch)
    : backend_(std::move(backend)), create_batch_(std::max<size_t>(create_batch, 1)) {
  std::lock_guard<std::mutex> lock(mu_);
  grow_locked(std::min(reserve_pages, backend_->capacity_pages()));
}

PagePool::~PagePool() {
  // Ranges destroyed during a capture and never drained: the pool goes, so their mappings and reservations
  // go now, without waiting (the ranges' users are gone; the backend frees the pages themselves).
  for (DeferredTeardown& t : teardowns_) {
    size_t done = 0;
    try {
      backend_->unmap_runs(t.va, t.runs.data(), t.runs.size(), &done);
      backend_->release(t.va, t.bytes);
    } catch (...) {
    }
  }
}

size_t PagePool::limit_locked() const { return std::min(limit_, backend_->capacity_pages()); }

size_t PagePool::set_limit(size_t pages) {
  release_deferred();  // a release a capture deferred goes first, now that it may
  std::lock_guard<std::mutex> lock(mu_);
  const size_t before = limit_locked();
  limit_ = std::max(std::min(pages, backend_->capacity_pages()), used_);
  if (limit_locked() < before) drop_kept_locked(0);  // the budget took pages back: their memory goes too
  // A budget that lowers the limit has given the difference to another member, who will create pages of
  // its own: on CUDA the free pages beyond the limit must let go of their device memory now, or, while a
  // CUDA graph capture runs (releasing would invalidate it), as soon as it ended.
  const size_t with_memory = backend_->created_pages();
  if (backend_->keeps_freed_memory() && with_memory > limit_) {
    if (capture_running()) {
      defer_release_locked(kReleaseToLimit);
    } else {
      release_free_locked(with_memory - limit_);
    }
  }
  return limit_;
}

void PagePool::defer_release_locked(int kind) {
  deferred_release_ = std::max(deferred_release_, kind);
  note_deferred_locked();
}

void PagePool::note_deferred_locked() {
  has_deferred_.store(true, std::memory_order_release);
  std::weak_ptr<PagePool> self = weak_from_this();  // empty for a pool not owned by a shared_ptr
  if (self.expired()) return;                       // such a pool drains at its next call only
  std::lock_guard<std::mutex> lock(deferred_pools_mu);
  for (const auto& w : deferred_pools)
    if (!w.owner_before(self) && !self.owner_before(w)) return;  // listed already
  deferred_pools.push_back(std::move(self));
}

void PagePool::defer_teardown(DeferredTeardown teardown) {
  std::lock_guard<std::mutex> lock(mu_);
  teardowns_.push_back(std::move(teardown));
  note_deferred_locked();
}

bool PagePool::finish_teardown(DeferredTeardown& t) {
  size_t done = 0;
  try {
    backend_->unmap_runs(t.va, t.runs.data(), t.runs.size(), &done);
  } catch (...) {
  }
  // The runs unmapped lose their references; the others stay mapped and referenced for a later try.
  size_t unmapped_pages = 0;
  for (size_t k = 0; k < done; ++k) unmapped_pages += t.runs[k].count;
  decref_all(std::vector<PageId>(t.pages.begin(), t.pages.begin() + static_cast<std::ptrdiff_t>(unmapped_pages)));
  t.runs.erase(t.runs.begin(), t.runs.begin() + static_cast<std::ptrdiff_t>(done));
  t.pages.erase(t.pages.begin(), t.pages.begin() + static_cast<std::ptrdiff_t>(unmapped_pages));
  if (!t.runs.empty()) return false;
  try {
    backend_->release(t.va, t.bytes);
  } catch (...) {
  }
  return true;
}

bool PagePool::release_deferred() {
  if (!has_deferred_.load(std::memory_order_acquire)) return true;
  std::vector<DeferredTeardown> teardowns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (capture_running()) return false;
    teardowns.swap(teardowns_);
  }
  // Outside the lock (finish_teardown drops references). Kernels queued before the capture may still use the
  // ranges' pages on streams nobody registered: the whole device is waited for first.
  std::vector<DeferredTeardown> left;
  if (!teardowns.empty()) {
    bool waited = true;
    try {
      backend_->synchronize_device();
    } catch (...) {
      waited = false;  // a capture began meanwhile, or a device error: try again later
    }
    for (DeferredTeardown& t : teardowns)
      if (!waited || !finish_teardown(t)) left.push_back(std::move(t));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (DeferredTeardown& t : left) teardowns_.push_back(std::move(t));
  if (deferred_release_ != kReleaseNone && !capture_running()) {
    // After the teardowns: their pages are free now and count too.
    if (deferred_release_ == kReleaseAll) {
      release_free_locked(free_.size());
    } else {
      const size_t with_memory = backend_->created_pages();
      if (with_memory > limit_locked()) release_free_locked(with_memory - limit_locked());
    }
    deferred_release_ = kReleaseNone;
  }
  const bool pending = deferred_release_ != kReleaseNone || !teardowns_.empty();
  has_deferred_.store(pending, std::memory_order_release);
  if (pending) note_deferred_locked();
  return !pending;
}

void PagePool::release_free_locked(size_t count) {
  count = std::min(count, free_.size());
  if (count == 0) return;
  const size_t gone = backend_->release_pages(free_.data(), count);
  released_.insert(released_.end(), free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(gone));
  free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(gone));
}

size_t PagePool::limit() const {
  std::lock_guard<std::mutex> lock(mu_);
  return limit_locked();
}

// Take in the pages the backend has created (all of them for the host backend), then, if fewer than
// `needed` are free, create more in batches, bounded by capacity.
void PagePool::grow_locked(size_t needed) {
  auto absorb = [this] {
    const size_t now = backend_->general_page_ids();
    if (now > general_ids_) {
      const size_t old = general_ids_;
      if (refcount_.size() < now) refcount_.resize(now, 0);
      if (owner_.size() < now) owner_.resize(now, PageOwner::kKVCache);
      // Freshly created pages go under the pages already free, in reverse, so that among them low ids
      // are handed out first (a run of consecutive ids maps in one host call).
      free_.insert(free_.begin(), now - old, 0);
      for (size_t i = 0; i < now - old; ++i) free_[i] = static_cast<PageId>(now - 1 - i);
      general_ids_ = now;
    }
  };
  absorb();
  // Never create past the limit: on CUDA a page with memory is device memory the budget must have granted.
  // Released ids (released_) are free ids too: they get memory back one by one as they are handed out.
  const size_t cap = limit_locked();
  const size_t with_memory = backend_->created_pages();
  const size_t free_ids = free_.size() + released_.size();
  if (free_ids < needed && general_ids_ < backend_->capacity_pages() && with_memory < cap) {
    const size_t want = std::max(needed - free_ids, create_batch_);
    backend_->create_pages(std::min(want, cap - with_memory));
    absorb();
  }
}

void PagePool::absorb_ids_locked() {
  const size_t ids = backend_->page_ids();
  if (ids > refcount_.size()) refcount_.resize(ids, 0);
  if (ids > owner_.size()) owner_.resize(ids, PageOwner::kKVCache);
}

// Every page counts against the capacity, home or general; general ones must also exist (CUDA creates
// them ahead of need, and creation can fall short of capacity).
void PagePool::check_budget_locked(size_t n, size_t general_needed) {
  const size_t cap = limit_locked();
  const size_t free_ids = free_.size() + released_.size();
  if (used_ + n > cap || free_ids < general_needed) {
    const size_t avail = std::min(cap - used_, free_ids + (n - general_needed));
    throw OutOfPages("page pool exhausted: " + std::to_string(n) + " page(s) of " +
                     std::to_string(backend_->page_size()) + " bytes requested, " + std::to_string(avail) +
                     " free of " + std::to_string(cap));
  }
}

std::vector<PageId> PagePool::acquire(size_t n, PageOwner owner) {
  return acquire_preferring(std::vector<PageId>(n, -1), owner);
}

std::vector<PageId> PagePool::acquire_preferring(const std::vector<PageId>& wanted, PageOwner owner) {
  if (has_deferred_.load(std::memory_order_acquire)) release_deferred();  // one atomic load when none is
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = wanted.size();
  const PageId first_home = static_cast<PageId>(general_ids_);
  std::vector<PageId> out(n, -1);  // -1: takes a general page
  size_t k = 0;                    // how many take a general page
  for (size_t i = 0; i < n; ++i) {
    const PageId w = wanted[i];
    if (w >= first_home && static_cast<size_t>(w) >= refcount_.size()) absorb_ids_locked();
    if (w >= first_home && static_cast<size_t>(w) < refcount_.size() && refcount_[w] == 0) {
      out[i] = w;
      refcount_[w] = 1;  // taken (so a page index listed twice cannot take it twice)
    } else {
      ++k;
    }
  }
  auto undo_homes = [&] {
    for (size_t i = 0; i < n; ++i)
      if (wanted[i] >= first_home && out[i] == wanted[i]) refcount_[out[i]] = 0;
  };
  try {
    if (free_.size() + released_.size() < k) grow_locked(k);
    check_budget_locked(n, k);
  } catch (...) {
    undo_homes();
    throw;
  }
  // The top of the free stack, lowest id first (consecutive ids map as one run); then, only when the pages
  // with memory are used up, released ids, which get memory again first (all or nothing: on failure nothing
  // was taken).
  const size_t from_free = std::min(k, free_.size());
  const size_t from_released = k - from_free;
  std::vector<PageId> general(k);
  for (size_t j = 0; j < from_free; ++j) general[j] = free_[free_.size() - 1 - j];
  for (size_t j = 0; j < from_released; ++j) general[from_free + j] = released_[released_.size() - 1 - j];
  try {
    if (from_released > 0) backend_->ensure_backed(general.data() + from_free, from_released);
  } catch (...) {
    undo_homes();
    throw;
  }
  free_.resize(free_.size() - from_free);
  released_.resize(released_.size() - from_released);
  for (size_t i = 0, j = 0; i < n; ++i)
    if (out[i] < 0) out[i] = general[j++];
  // Kept pages read what they held: zero_on_reuse zeroes those too (a punched hole on the host).
  std::vector<PageId> to_zero = unkeep_locked(out);
  if (zero_on_reuse_ && !backend_->freed_pages_read_zero()) to_zero = out;
  if (zero_on_reuse_ && !to_zero.empty()) {
    try {
      backend_->zero_pages(to_zero.data(), to_zero.size(), 0);
    } catch (...) {
      // The general pages back where they came from, in the order they came off; the re-created ones give
      // their memory back again.
      const size_t gone = from_released > 0 ? backend_->release_pages(general.data() + from_free, from_released) : 0;
      for (size_t j = from_released; j-- > 0;) (j < gone ? released_ : free_).push_back(general[from_free + j]);
      for (size_t j = from_free; j-- > 0;) free_.push_back(general[j]);
      undo_homes();
      backend_->discard_pages(to_zero.data(), to_zero.size());  // no longer kept: their memory goes back
      throw;
    }
  }
  for (PageId p : out) {
    refcount_[p] = 1;
    owner_[p] = owner;
  }
  owned_[static_cast<size_t>(owner)] += n;
  used_ += n;
  high_water_ = std::max(high_water_, used_);
  return out;
}

void PagePool::set_zero_on_reuse(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  zero_on_reuse_ = on;
}

bool PagePool::zero_on_reuse() const {
  std::lock_guard<std::mutex> lock(mu_);
  return zero_on_reuse_;
}

void PagePool::set_keep_freed(size_t pages) {
  std::lock_guard<std::mutex> lock(mu_);
  keep_freed_ = backend_->keeps_freed_memory() ? 0 : pages;
  drop_kept_locked(keep_freed_);
}

size_t PagePool::keep_freed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return keep_freed_;
}

void PagePool::discard_or_keep_locked(const std::vector<PageId>& freed) {
  if (keep_freed_ == 0) {
    backend_->discard_pages(freed.data(), freed.size());
    return;
  }
  if (kept_stamp_.size() < refcount_.size()) kept_stamp_.resize(refcount_.size(), 0);
  for (PageId p : freed) {
    kept_stamp_[p] = next_stamp_;
    kept_.emplace_back(p, next_stamp_++);
    ++kept_count_;
  }
  drop_kept_locked(keep_freed_);
  // Pages handed out again leave stale entries behind, which only drop_kept_locked pops: a pool that frees and
  // reuses pages below the bound would collect them without end. Compact when they outnumber the live ones.
  if (kept_.size() > 2 * kept_count_ + 1024) {
    std::deque<std::pair<PageId, uint64_t>> live;
    for (const auto& e : kept_)
      if (kept_stamp_[e.first] == e.second) live.push_back(e);
    kept_.swap(live);
  }
}

void PagePool::drop_kept_locked(size_t keep) {
  std::vector<PageId> gone;
  while (kept_count_ > keep) {
    const auto [page, stamp] = kept_.front();
    kept_.pop_front();
    if (kept_stamp_[page] != stamp) continue;  // stale: handed out, or kept again further back
    kept_stamp_[page] = 0;
    --kept_count_;
    gone.push_back(page);
  }
  if (kept_count_ == 0) kept_.clear();  // only stale entries left
  if (!gone.empty()) backend_->discard_pages(gone.data(), gone.size());
}

std::vector<PageId> PagePool::unkeep_locked(const std::vector<PageId>& pages) {
  std::vector<PageId> were;
  if (kept_count_ == 0) return were;
  for (PageId p : pages) {
    if (static_cast<size_t>(p) < kept_stamp_.size() && kept_stamp_[p] != 0) {
      kept_stamp_[p] = 0;  // its entry in kept_ goes stale
      --kept_count_;
      were.push_back(p);
    }
  }
  if (kept_count_ == 0) kept_.clear();
  return were;
}

void PagePool::zero_pages(const std::vector<PageId>& pages, uintptr_t stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (PageId p : pages) {
      check(p);
      if (refcount_[p] <= 0) throw InvalidArgument("zero_pages of free page " + std::to_string(p));
    }
  }
  backend_->zero_pages(pages.data(), pages.size(), stream);
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

bool PagePool::release_locked(PageId page) {
  if (static_cast<size_t>(page) < file_page_.size() && file_page_[page] != kOwnPage) {
    if (file_page_[page] == kImportedPage) {
      --imported_pages_;
      backend_->release_imported_page(page);
    } else {
      --file_pages_;
      backend_->detach_file_page(page);
    }
    file_page_[page] = kOwnPage;
    return false;
  }
  if (page < static_cast<PageId>(general_ids_)) free_.push_back(page);  // home ids are free at count 0
  --used_;
  --owned_[static_cast<size_t>(owner_[page])];
  return true;
}

std::vector<PageId> PagePool::attach_file_pages(int fd, const std::vector<uint64_t>& offsets) {
  if (!backend_->can_attach_file_pages()) {
    throw InvalidArgument("this pool's backend (" + backend_->device() + ") cannot map pages of a file");
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PageId> ids(offsets.size());
  backend_->attach_file_pages(fd, offsets.data(), offsets.size(), ids.data());
  try {
    adopt_foreign_locked(ids, kFilePage);
  } catch (...) {
    for (PageId id : ids) backend_->detach_file_page(id);
    throw;
  }
  return ids;
}

void PagePool::adopt_foreign_locked(const std::vector<PageId>& ids, ForeignPage kind) {
  absorb_ids_locked();
  if (file_page_.size() < refcount_.size()) file_page_.resize(refcount_.size(), kOwnPage);
  for (PageId id : ids) {
    refcount_[id] = 1;
    file_page_[id] = kind;
  }
  (kind == kImportedPage ? imported_pages_ : file_pages_) += ids.size();
}

bool PagePool::is_file_page(PageId page) const {
  std::lock_guard<std::mutex> lock(mu_);
  check(page);
  return static_cast<size_t>(page) < file_page_.size() && file_page_[page] == kFilePage;
}

std::vector<int> PagePool::export_pages(const std::vector<PageId>& pages) {
  if (!backend_->can_share_pages()) {
    throw InvalidArgument("this pool's backend (" + backend_->device() +
                          ") cannot share pages with other processes: " + backend_->share_unavailable_reason());
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (PageId p : pages) {
    check(p);
    if (refcount_[p] <= 0) throw InvalidArgument("export of free page " + std::to_string(p));
  }
  std::vector<int> fds;
  fds.reserve(pages.size());
  try {
    for (PageId p : pages) fds.push_back(backend_->export_page(p));
  } catch (...) {
    for (int fd : fds) ::close(fd);
    throw;
  }
  return fds;
}

std::vector<PageId> PagePool::import_pages(const std::vector<int>& fds) {
  if (!backend_->can_share_pages()) {
    throw InvalidArgument("this pool's backend (" + backend_->device() +
                          ") cannot share pages with other processes: " + backend_->share_unavailable_reason());
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PageId> ids(fds.size());
  backend_->import_pages(fds.data(), fds.size(), ids.data());
  try {
    adopt_foreign_locked(ids, kImportedPage);
  } catch (...) {
    for (PageId id : ids) backend_->release_imported_page(id);
    throw;
  }
  return ids;
}

bool PagePool::is_foreign_page(PageId page) const {
  std::lock_guard<std::mutex> lock(mu_);
  check(page);
  return static_cast<size_t>(page) < file_page_.size() && file_page_[page] != kOwnPage;
}

bool PagePool::is_imported_page(PageId page) const {
  std::lock_guard<std::mutex> lock(mu_);
  check(page);
  return static_cast<size_t>(page) < file_page_.size() && file_page_[page] == kImportedPage;
}

void PagePool::decref(PageId page) { decref_all({page}); }

void PagePool::decref_all(const std::vector<PageId>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PageId> freed;
  freed.reserve(pages.size());
  for (PageId p : pages) {
    check(p);
    if (refcount_[p] <= 0) throw InvalidArgument("decref of free page " + std::to_string(p));
    if (--refcount_[p] == 0 && release_locked(p)) freed.push_back(p);
  }
  // The memory of a free page goes back at once (host: one punched hole per run of ids), so the process
  // never holds more RAM than its pages in use, however many different home pages it has touched; or, with
  // set_keep_freed, more than that plus the pages kept.
  if (!freed.empty()) discard_or_keep_locked(freed);
}

int32_t PagePool::refcount(PageId page) const {
  std::lock_guard<std::mutex> lock(mu_);
  check(page);
  return refcount_[page];
}

size_t PagePool::free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t cap = limit_locked();
  return cap > used_ ? cap - used_ : 0;
}

PoolStats PagePool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t total = backend_->capacity_pages();  // the ceiling; free_pages counts up to the limit
  const size_t cap = limit_locked();
  return PoolStats{backend_->page_size(),
                   total,
                   used_,
                   cap > used_ ? cap - used_ : 0,
                   high_water_,
                   backend_->created_pages(),
                   owned_[static_cast<size_t>(PageOwner::kKVCache)],
                   owned_[static_cast<size_t>(PageOwner::kAllocator)],
                   kept_count_,
                   backend_->unmap_fallbacks(),
                   deferred_release_ != kReleaseNone,
                   teardowns_.size(),
                   file_pages_,
                   imported_pages_};
}

size_t PagePool::trim() {
  release_deferred();
  std::lock_guard<std::mutex> lock(mu_);
  drop_kept_locked(0);
  // Host: holes punched, every id stays in free_; CUDA: handles released, or, while a CUDA graph capture runs,
  // once it ended (see the class comment).
  if (backend_->keeps_freed_memory() && capture_running()) {
    defer_release_locked(kReleaseAll);
  } else {
    release_free_locked(free_.size());
  }
  const size_t cap = limit_locked();
  return std::min(free_.size() + released_.size(), cap > used_ ? cap - used_ : 0);
}

void PagePool::reset_high_water() {
  std::lock_guard<std::mutex> lock(mu_);
  high_water_ = used_;
}

}  // namespace vpaged
