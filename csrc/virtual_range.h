// VirtualRange: one reserved span of virtual addresses cut into page-sized slots, each either unmapped
// or backed by one physical page of a PagePool. The range owns one pool reference per mapped slot, so
// one physical page may sit behind several slots (in this or other ranges): the basis of sharing.
//
// Safety rule: a tensor view handed out by view() pins the slots it covers; a pinned slot is never
// unmapped or remapped (those calls raise), so no view ever reaches unmapped memory. The range itself
// (reservation and pages) lives until the last view of it is gone.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "page_pool.h"

namespace vpaged {

class VirtualRange : public std::enable_shared_from_this<VirtualRange> {
 public:
  VirtualRange(std::shared_ptr<PagePool> pool, size_t bytes);
  ~VirtualRange();
  VirtualRange(const VirtualRange&) = delete;
  VirtualRange& operator=(const VirtualRange&) = delete;

  uintptr_t address() const { return va_; }
  size_t bytes() const { return slots_ * page_size_; }
  size_t num_slots() const { return slots_; }
  size_t page_size() const { return page_size_; }
  size_t mapped_slots() const;
  PagePool& pool() { return *pool_; }
  const std::shared_ptr<PagePool>& pool_ptr() const { return pool_; }

  // Map fresh pages from the pool at the given (unmapped) slots. All or nothing: on OutOfPages or a
  // mapping failure nothing changes. Returns the page ids.
  std::vector<PageId> map_new(const std::vector<int64_t>& slots);
  // Map existing pages (taking a reference on each) at the given unmapped slots. All or nothing.
  void map_shared(const std::vector<int64_t>& slots, const std::vector<PageId>& pages);
  // Unmap the slots (which must be mapped and unpinned) and drop their references.
  void unmap(const std::vector<int64_t>& slots);
  // Give slot a private copy of its page: a fresh page receives the data, replaces the shared one at
  // the same address, and the old page loses a reference. All or nothing. Returns the new page.
  PageId copy_on_write(int64_t slot, uintptr_t stream);
  // Copy-on-write every listed slot whose page is shared (reference count > 1). Checks first that the
  // pool has a page for each copy (OutOfPages, nothing changed). Returns the number of copies made.
  size_t make_private(const std::vector<int64_t>& slots, uintptr_t stream);
  // Make slots[i] show pages[i] (-1: unmapped), taking references on the new pages and dropping those of
  // the pages replaced. The pages are held while the slots change, so one slot may take the page another
  // slot in the same call gives up (reordering beams). Slots must be unpinned where they change.
  void assign(const std::vector<int64_t>& slots, const std::vector<PageId>& pages);
  // Reference counts of the pages behind the slots (0 where unmapped).
  std::vector<int32_t> refcounts_at(const std::vector<int64_t>& slots) const;

  PageId page_at(int64_t slot) const;           // -1 when unmapped
  std::vector<PageId> pages_at(const std::vector<int64_t>& slots) const;
  int32_t pins_at(int64_t slot) const;
  // True when every byte of [offset, offset + len) lies in mapped slots.
  bool is_mapped(size_t offset, size_t len) const;

  // A DLPack tensor over [offset, offset + extent) of the range; throws unless all of it is mapped.
  // Pins the covered slots until the tensor is deleted.
  void* make_dlpack(size_t offset, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                    int dtype_code, int dtype_bits);
  void unpin(int64_t first, int64_t last);

  // Unmap every unpinned slot and return its pages; release() in the destructor does the rest.
  void unmap_all_unpinned();

 private:
  void check_slot(int64_t slot) const;
  void collect_spans(size_t offset, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                     size_t dim, size_t itemsize, std::vector<std::pair<size_t, size_t>>& out) const;
  void unmap_locked(const std::vector<int64_t>& slots);
  // Show `page` at a mapped slot instead of `old` (references are the caller's business); on failure the
  // slot shows `old` again and the error is rethrown.
  void remap_locked(int64_t slot, PageId old, PageId page);
  // Map pages (in order) over runs of slots; on failure unmap what was mapped, drop the caller's page
  // references and rethrow.
  void map_runs_or_undo(const std::vector<std::pair<int64_t, int64_t>>& slot_runs, const std::vector<PageId>& pages);
  // The backend's home page of each slot (-1 where it has none): what the pool hands out when free.
  std::vector<PageId> home_pages(const std::vector<int64_t>& slots) const;
  // Group sorted slots into runs of consecutive slots: (first, count) pairs.
  static std::vector<std::pair<int64_t, int64_t>> runs(std::vector<int64_t> slots);

  std::shared_ptr<PagePool> pool_;
  size_t page_size_;
  size_t slots_;
  uintptr_t va_ = 0;
  mutable std::mutex mu_;
  std::vector<PageId> table_;
  std::vector<int32_t> pins_;
  size_t mapped_ = 0;
};

}  // namespace vpaged
