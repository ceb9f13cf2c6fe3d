// PagePool: the physical pages of one backend (one device, one page size), with a capacity, a free
// list and reference counts. A page is "used" while its count is above zero; ranges that map it hold
// the references. Thread-safe: every public call takes the pool's mutex.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "core/backend.h"

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
  size_t created_pages;       // pages with memory now (Backend::created_pages): on CUDA it falls when trim releases
  size_t kv_pages;            // used pages owned by KV caches (ranges, copy-on-write)
  size_t allocator_pages;     // used pages owned by the torch allocator hook and vpaged.empty
  size_t kept_free_pages;     // free pages that kept their memory (set_keep_freed): resident, not in use
  size_t unmap_fallbacks;     // runs the driver refused to unmap as one call, unmapped page by page (Backend)
  bool release_pending;       // a trim or lowered limit waits for a CUDA graph capture to end (see below)
  size_t deferred_teardowns;  // ranges destroyed during a capture, waiting to be unmapped (see below)
  size_t file_pages;          // file pages attached and referenced (attach_file_pages): not in used_pages
  size_t imported_pages;      // device pages of another process imported and referenced (import_pages): likewise
};

// A range destroyed while a CUDA graph capture ran: its pages stay mapped and referenced and its reservation
// stays, until the pool can wait for the device and unmap them (PagePool::release_deferred).
struct DeferredTeardown {
  uintptr_t va;
  size_t bytes;
  std::vector<IndexRun> runs;  // the mapped indices, in runs
  std::vector<PageId> pages;   // the pages shown by the runs, in order (one reference each)
};

// CUDA GRAPH CAPTURE. While a capture runs in the default (global) mode, a cuMemUnmap, cuMemRelease, cuMemCreate,
// cuMemMap or cuMemSetAccess from any thread of the process invalidates it. The pool therefore never releases
// memory while a capture runs: a trim, or a lowered limit, records what it would release (the limit itself is
// set at once, so nothing more is handed out) and releases it at the first chance after the capture ended (the
// next set_limit, trim or acquire, or end_capture's drain). Likewise a range destroyed during a capture leaves
// its teardown here (defer_teardown). "A capture runs": the process-wide capture flag is up (begin_capture /
// end_capture, counted; vpaged.memory.graph_capture() raises it around torch.cuda.graph and vLLM's capture), or
// the backend says the legacy stream may not be used now (Backend::capturing(0): a global-mode capture).
class PagePool : public std::enable_shared_from_this<PagePool> {
 public:
  // reserve_pages: physical pages created at construction (the rest in batches as needed).
  PagePool(std::shared_ptr<Backend> backend, size_t reserve_pages = 0, size_t create_batch = 64);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // The process-wide capture flag (counted: nested and concurrent captures each raise it once). The last
  // end_capture releases what every pool deferred. Thread-safe.
  static void begin_capture();
  static void end_capture();
  static bool capture_flagged();
  // Whether releases are deferred now: on a backend whose mapping calls break a capture, the capture flag
  // or the backend's legacy-stream answer.
  bool capture_running() const;
  // Do what a capture deferred (releases, range teardowns) unless a capture still runs; returns true when
  // nothing is left pending. Teardowns first wait for the whole device (Backend::synchronize_device).
  bool release_deferred();
  // Keep a destroyed range's mappings, references and reservation until release_deferred can unmap them.
  void defer_teardown(DeferredTeardown teardown);

  Backend& backend() { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const { return backend_; }
  size_t page_size() const { return backend_->page_size(); }

  // n fresh pages, each with reference count 1 owned by the caller. All or nothing: throws OutOfPages
  // and changes nothing when fewer than n are free.
  std::vector<PageId> acquire(size_t n, PageOwner owner = PageOwner::kKVCache);
  // Like acquire(wanted.size()), but page i is wanted[i] where that is a free home page (see
  // Backend::home_page; -1: no preference), else a general page. Every page counts against capacity.
  std::vector<PageId> acquire_preferring(const std::vector<PageId>& wanted, PageOwner owner = PageOwner::kKVCache);
  // Option: pages read as zeros when they change owner (handed out again by acquire*, or re-zeroed with
  // zero_pages when a cache gives a freed sequence's pages to a new one). Off by default.
  void set_zero_on_reuse(bool on);
  bool zero_on_reuse() const;
  // Option (host): up to `pages` pages whose last reference went keep their memory instead of giving it back at
  // once, the most recently freed ones, so that a page handed out again soon (a copy-on-write's fresh page, a
  // swapped-out sequence's pages on swap in) is written in place instead of being allocated and zeroed by the
  // kernel first. The process then holds at most `pages` pages of memory beyond those in use. Such a page
  // reads what it held, not zeros (zero_on_reuse still zeroes it when handed out). trim() and a lowered
  // limit give all of it back. 0 (the default): every free page's memory goes back at once. No effect where
  // the backend keeps freed memory anyway (CUDA, until trim).
  void set_keep_freed(size_t pages);
  size_t keep_freed() const;
  // Make pages read as zeros now (through the backend: a punched hole on the host, a copy on CUDA).
  void zero_pages(const std::vector<PageId>& pages, uintptr_t stream = 0);
  // Pages of a file (a page store's data file), mapped into ranges with no copy: one id per offset, each with
  // reference count 1 owned by the caller (Backend::attach_file_pages says what a file page is). They do not count
  // against the capacity or the limit (their memory is the file's, not the pool's): stats().file_pages counts
  // them. When a file page's last reference goes, its id is detached from the backend. InvalidArgument where the
  // backend cannot map file pages (CUDA, the accounting backend) or an offset is not a page of the file.
  std::vector<PageId> attach_file_pages(int fd, const std::vector<uint64_t>& offsets);
  bool is_file_page(PageId page) const;
  // Device pages shared between processes (CUDA; Backend::can_share_pages says where): export_pages gives one new
  // POSIX file descriptor per page in use, the caller's to send and close; import_pages gives each received
  // descriptor's page an id with reference count 1 owned by the caller, read-only (a writer copies it first), not
  // counted against the capacity or the limit (the memory is the exporter's): stats().imported_pages counts them,
  // and the id goes back to the backend with its last reference. InvalidArgument where the backend cannot share
  // pages, for a free page to export, or a descriptor that is not a page of this pool's size and device; all or
  // nothing (export: descriptors made before a failure are closed).
  std::vector<int> export_pages(const std::vector<PageId>& pages);
  std::vector<PageId> import_pages(const std::vector<int>& fds);
  bool is_imported_page(PageId page) const;
  // A file page or an imported page: memory that is not the pool's, read-only to the ranges (copy before writing).
  bool is_foreign_page(PageId page) const;
  void incref(PageId page);
  void incref_all(const std::vector<PageId>& pages);
  // Drops one reference; a page whose count reaches zero goes back on the free list.
  void decref(PageId page);
  void decref_all(const std::vector<PageId>& pages);
  int32_t refcount(PageId page) const;
  size_t free_pages() const;
  PoolStats stats() const;
  // Give the memory of every free page back to the system where the backend can (host: holes punched;
  // CUDA: handles released, re-created when the ids are handed out again). Returns the pages free.
  size_t trim();
  // The pages the pool may have in use at once: the backend's capacity unless lowered (a machine-wide
  // budget grants the pool part of it: vpaged/memory/budget/shared.py). set_limit never goes below the
  // pages in use nor above capacity: it returns the limit it set, clamped, under the same lock as acquire,
  // so a shrink racing an acquire can never leave used pages above the limit. On a backend that keeps the
  // memory of free pages (CUDA), lowering the limit also releases free pages until those with memory fit in
  // it: device memory the budget took back is really free for another process.
  size_t set_limit(size_t pages);
  size_t limit() const;
  void reset_high_water();

 private:
  void check(PageId page) const;
  void grow_locked(size_t needed);
  // Size the reference counts to every id the backend has (home ids appear as ranges are reserved).
  void absorb_ids_locked();
  void check_budget_locked(size_t n, size_t general_needed);
  // A page's last reference went: back on the free list (general ids) and its memory to the system; a file
  // page is detached instead. Returns whether the page's memory is the pool's to give back (not a file page).
  bool release_locked(PageId page);
  void zero_acquired_locked(const std::vector<PageId>& pages);
  // Release the memory of free_[0..count) (the least recently freed); those released move to released_.
  void release_free_locked(size_t count);
  // Pages freed by decref: kept (keep_freed_) or their memory given back; then the kept beyond the bound.
  void discard_or_keep_locked(const std::vector<PageId>& freed);
  // Give back the memory of the oldest kept pages until at most `keep` remain.
  void drop_kept_locked(size_t keep);
  // Pages handed out again stop being kept; returns those that were (zero_on_reuse zeroes them).
  std::vector<PageId> unkeep_locked(const std::vector<PageId>& pages);

  std::shared_ptr<Backend> backend_;
  size_t create_batch_;
  mutable std::mutex mu_;
  std::vector<int32_t> refcount_;
  std::vector<PageOwner> owner_;  // valid while the page is used
  size_t owned_[kPageOwners] = {};
  std::vector<PageId> free_;  // general ids only; a stack: the most recently freed page is reused first
  // Free general ids whose memory release_pages gave back (CUDA trim): handed out after free_ is used up,
  // once ensure_backed gave them memory again. So the pages with memory are at most max(limit, what they
  // were): an id is re-created only when no free page has memory.
  std::vector<PageId> released_;
  size_t general_ids_ = 0;  // ids below this are general (capacity); above: home ids (free at count 0)
  bool zero_on_reuse_ = false;
  // Kept free pages (set_keep_freed), oldest first, each with the stamp it was kept under: an entry whose page
  // was handed out (kept_stamp_[id] cleared) or kept again since (a newer stamp) is stale and skipped.
  size_t keep_freed_ = 0;
  std::deque<std::pair<PageId, uint64_t>> kept_;
  std::vector<uint64_t> kept_stamp_;  // per page id: the stamp of its live entry in kept_, 0 if not kept
  uint64_t next_stamp_ = 1;
  size_t kept_count_ = 0;  // live entries of kept_
  size_t used_ = 0;
  // Per page id: kFilePage while it is an attached file page, kImportedPage while an imported device page.
  enum ForeignPage : uint8_t { kOwnPage = 0, kFilePage = 1, kImportedPage = 2 };
  std::vector<uint8_t> file_page_;
  size_t file_pages_ = 0;
  size_t imported_pages_ = 0;
  // Ids a backend gave for foreign memory (file or imported pages): reference count 1 each, marked `kind`.
  void adopt_foreign_locked(const std::vector<PageId>& ids, ForeignPage kind);
  size_t high_water_ = 0;
  size_t limit_ = SIZE_MAX;  // clamped to the backend's capacity where read (limit_locked)
  size_t limit_locked() const;
  // What a capture deferred (see the class comment): kReleaseToLimit (free pages with memory beyond the
  // limit), kReleaseAll (every free page, a trim), and the teardowns. has_deferred_: either is pending (read
  // without the lock on the hot path).
  enum DeferredRelease : int { kReleaseNone = 0, kReleaseToLimit = 1, kReleaseAll = 2 };
  int deferred_release_ = kReleaseNone;
  std::vector<DeferredTeardown> teardowns_;
  std::atomic<bool> has_deferred_{false};
  void defer_release_locked(int kind);
  void note_deferred_locked();  // has_deferred_ set and the pool listed for end_capture's drain
  // Unmap a teardown's runs, drop their pages' references, release the reservation; false (the runs not
  // unmapped left in it) when the backend refused.
  bool finish_teardown(DeferredTeardown& t);
};

}  // namespace vpaged
