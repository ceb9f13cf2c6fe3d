// VirtualRange: one reserved span of virtual addresses cut into pages, each either unmapped
// or backed by one physical page of a PagePool. The range owns one pool reference per mapped index, so
// one physical page may sit behind several indices (in this or other ranges): the basis of sharing.
//
// A "page index" (just "index" in this file) names a page-sized piece of the range, numbered from 0, in C++
// and Python alike (Layout.page_indices() returns them). A "slot" is something else: a sequence's row in
// the Python caches.
//
// Safety rules, enforced here so that no caller (the Python caches, a C++ client) can forget them:
// - Pins: a tensor view handed out by make_dlpack() pins the page indices it covers. A pinned page index is
//   never unmapped or remapped: unmap() and assign() raise ViewsAlive, so no view ever reaches unmapped
//   memory. Copy-on-write does remap pinned indices: the index shows the same bytes before and after, so a
//   view of it stays valid (it sees the private copy from then on).
// - Wait before unmap: kernels queued on a stream may still read a page when the host decides to unmap
//   it, and cuMemUnmap does not reliably wait for them. Every call that unmaps or remaps a page index
//   (unmap, assign, copy_on_write, make_private, unmap_all_unpinned, the destructor) first waits for the
//   streams registered with add_stream() (Backend::synchronize each; a no-op on the host). Mapping fresh
//   pages needs no wait: nothing can be reading them yet.
// - CUDA graph captures (page_pool.h): while one runs (the process flag, the legacy stream, a registered
//   stream), unmapping and remapping are refused with CaptureActive, nothing changed; under the process flag
//   mapping is refused too; the destructor then hands its mappings, references and reservation to the pool,
//   which tears them down after the capture.
// The range itself (reservation and pages) lives until the last view of it is gone.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "core/page_pool.h"

namespace vpaged {

class VirtualRange : public std::enable_shared_from_this<VirtualRange> {
 public:
  VirtualRange(std::shared_ptr<PagePool> pool, size_t bytes);
  ~VirtualRange();
  VirtualRange(const VirtualRange&) = delete;
  VirtualRange& operator=(const VirtualRange&) = delete;

  uintptr_t address() const { return va_; }
  size_t bytes() const { return num_pages_ * page_size_; }
  size_t num_pages() const { return num_pages_; }
  size_t page_size() const { return page_size_; }
  size_t mapped_pages() const;
  PagePool& pool() { return *pool_; }
  const std::shared_ptr<PagePool>& pool_ptr() const { return pool_; }

  // Map fresh pages from the pool at the given (unmapped) indices. All or nothing: on OutOfPages or a
  // mapping failure nothing changes. Returns the page ids.
  std::vector<PageId> map_new(const std::vector<int64_t>& indices);
  // Map existing pages (taking a reference on each) at the given unmapped indices. All or nothing.
  void map_shared(const std::vector<int64_t>& indices, const std::vector<PageId>& pages);
  // Unmap the indices (which must be mapped and unpinned) and drop their references.
  void unmap(const std::vector<int64_t>& indices);
  // Give index a private copy of its page: a fresh page (its home page where free) receives the data, replaces
  // the shared one at the same address, and the old page loses a reference. All or nothing, at the host's
  // mapping limit too (Backend::remap). Returns the new page.
  PageId copy_on_write(int64_t index, uintptr_t stream);
  // Copy-on-write every listed index whose page is shared (reference count > 1). Takes a fresh page for
  // each copy first (OutOfPages, nothing changed), then copies and remaps them all as one change: all or
  // nothing (MappingLimit at the host's mapping limit: nothing changed). Returns the number of copies made.
  size_t make_private(const std::vector<int64_t>& indices, uintptr_t stream);
  // The number of copies make_private(indices) makes: one per listed index with a shared page, less one per
  // page whose every reference is a listed index (the last of them keeps the original).
  size_t copies_needed(const std::vector<int64_t>& indices) const;
  // Make indices[i] show pages[i] (-1: unmapped), taking references on the new pages and dropping those of
  // the pages replaced. The pages are held while the indices change, so one index may take the page another
  // index in the same call gives up (reordering beams). Indices must be unpinned where they change. All or
  // nothing, at the host's mapping limit too (Backend::remap).
  void assign(const std::vector<int64_t>& indices, const std::vector<PageId>& pages);
  // Beam search in one call (VirtualKVCache.reorder, every row and layer of a step): for each k, the indices
  // [dst[k], dst[k] + span[k]) show what [src[k], src[k] + count[k]) showed before the call, and nothing past
  // count[k]. Indices that show their new page already are not touched; the others change in one
  // Backend::remap (runs of consecutive indices with one call each on the host), as assign() does. tail[k] > 0:
  // the last of those pages holds tokens in its first tail[k] bytes only (a beam's partly filled last page).
  // Where the destination's own page there is private (reference count 1) and no other entry shares it, those
  // bytes are copied into it instead of sharing the source's page: no mapping changes, and the copy-on-write
  // that its next token would make is done. Such copies run in an order that reads each page before it is
  // written; beams trading last pages in a cycle share them instead. Destination runs must not overlap. No page
  // is taken from the pool. All or nothing (InvalidArgument, ViewsAlive on a pinned index that would change,
  // MappingLimit: nothing changed). Returns the number of tails copied.
  size_t reorder_runs(const std::vector<int64_t>& dst, const std::vector<int64_t>& src,
                      const std::vector<int64_t>& count, const std::vector<int64_t>& span,
                      const std::vector<int64_t>& tail, uintptr_t stream);
  // Reference counts of the pages behind the indices (0 where unmapped).
  std::vector<int32_t> refcounts_at(const std::vector<int64_t>& indices) const;

  PageId page_at(int64_t index) const;  // -1 when unmapped
  std::vector<PageId> pages_at(const std::vector<int64_t>& indices) const;
  int32_t pins_at(int64_t index) const;
  // True when every byte of [offset, offset + len) lies in mapped indices.
  bool is_mapped(size_t offset, size_t len) const;

  // A DLPack tensor over [offset, offset + extent) of the range; throws unless all of it is mapped.
  // Pins the covered indices until the tensor is deleted.
  void* make_dlpack(size_t offset, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                    int dtype_code, int dtype_bits);
  void unpin(int64_t first, int64_t last);

  // Unmap every unpinned index and return its pages; release() in the destructor does the rest.
  void unmap_all_unpinned();

  // Streams (CUDA stream handles; 0 is the legacy default stream) whose queued work may read this range:
  // every unmap or remap waits for all of them first. Adding a stream twice keeps one entry.
  void add_stream(uintptr_t stream);
  void remove_stream(uintptr_t stream);
  std::vector<uintptr_t> streams() const;
  // Wait for the registered streams now (before reading pages out through the pool, e.g. to swap them).
  void wait_for_streams();
  // How many of the indices are pinned by live views.
  size_t pinned_count(const std::vector<int64_t>& indices) const;

 private:
  // Inline: called per page on every map and unmap.
  void check_index(int64_t index) const {
    if (static_cast<uint64_t>(index) >= num_pages_) index_out_of_range(index);
  }
  [[noreturn]] void index_out_of_range(int64_t index) const;
  // CaptureActive while the process-wide capture flag is up on a backend whose mapping breaks a capture.
  void refuse_mapping_during_capture(const char* call) const;
  void collect_spans(size_t offset, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, size_t dim,
                     size_t itemsize, std::vector<std::pair<size_t, size_t>>& out) const;
  void unmap_locked(const std::vector<int64_t>& indices);
  // The listed indices make_private copies: those whose page is shared, but not the last listed index of a page
  // every reference of which is a listed index (it keeps the original).
  std::vector<int64_t> copy_plan_locked(const std::vector<int64_t>& indices) const;
  // Wait for the work queued on every registered stream (see the safety rules above).
  void wait_for_streams_locked();
  // Copy the indices' pages into `fresh` (pages the caller acquired, one per index) and show those instead, in
  // one Backend::remap; the old pages lose the indices' references. All or nothing: on failure the fresh pages
  // are dropped and the indices show their old pages.
  void copy_into_locked(const std::vector<int64_t>& indices, const std::vector<PageId>& fresh, uintptr_t stream);
  // reorder_runs' tail copies: of the entries with a candidate tail (tail_index[k] >= 0: the destination index
  // of entry k's tail, whose page is private), those that may copy, in an order that reads every page before it
  // is written (see reorder_runs).
  static std::vector<size_t> in_place_order(const std::vector<int64_t>& src, const std::vector<int64_t>& count,
                                            const std::vector<int64_t>& tail_index);
  // After a Backend::remap that failed: drop the references taken on `pages`, except where the backend lost an
  // index (it is unmapped then, and its pages keep their references).
  // Remap the indices `at` from olds to news (the incoming pages already hold a reference for them) and commit
  // the table and the mapped count; returns the replaced pages, whose references the caller drops. On a failed
  // remap, drop_after_failed_remap, then the error.
  std::vector<PageId> remap_held_locked(const std::vector<size_t>& at, const std::vector<PageId>& olds,
                                        const std::vector<PageId>& news);
  void drop_after_failed_remap(const std::vector<size_t>& at, const std::vector<PageId>& olds,
                               const std::vector<PageId>& pages, const bool* lost);
  // Map pages (in order) over runs of indices; on failure unmap what was mapped, drop the caller's page
  // references and rethrow.
  void map_runs_or_undo(const std::vector<IndexRun>& index_runs, const std::vector<PageId>& pages);
  // The backend's home page of each index (-1 where it has none): what the pool hands out when free.
  std::vector<PageId> home_pages(const std::vector<int64_t>& indices) const;
  // Group sorted indices into runs of consecutive indices.
  static std::vector<IndexRun> runs(const std::vector<int64_t>& indices);
  // False when an index is listed twice. `sorted` receives the indices sorted, unless they already are (then
  // it stays empty: use `indices`).
  static bool sort_unique(const std::vector<int64_t>& indices, std::vector<int64_t>& sorted);

  std::shared_ptr<PagePool> pool_;
  size_t page_size_;
  size_t num_pages_;
  uintptr_t va_ = 0;
  PageId home_base_ = -1;  // the backend's home page of index 0 (-1: none)
  mutable std::mutex mu_;
  std::vector<PageId> table_;
  std::vector<int32_t> pins_;
  size_t mapped_ = 0;
  std::vector<uintptr_t> streams_;
};

}  // namespace vpaged
