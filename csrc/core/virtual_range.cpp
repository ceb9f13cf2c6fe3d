#include "core/virtual_range.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "core/dlpack.h"
#include "core/errors.h"

namespace vpaged {

VirtualRange::VirtualRange(std::shared_ptr<PagePool> pool, size_t bytes)
    : pool_(std::move(pool)), page_size_(pool_->page_size()) {
  if (bytes == 0) throw InvalidArgument("a virtual range needs a positive size");
  num_pages_ = (bytes + page_size_ - 1) / page_size_;
  va_ = pool_->backend().reserve(num_pages_ * page_size_);
  home_base_ = pool_->backend().home_page(va_);  // fixed for the reservation's life
  table_.assign(num_pages_, -1);
  pins_.assign(num_pages_, 0);
}

VirtualRange::~VirtualRange() {
  // Destroyed only when no view pins it (views hold a shared_ptr): every index can go.
  std::vector<int64_t> mapped;
  for (size_t s = 0; s < num_pages_; ++s)
    if (table_[s] >= 0) mapped.push_back(static_cast<int64_t>(s));
  try {
    if (!mapped.empty()) {
      // A capture runs (the process flag, the legacy stream, or a registered stream): the wait and the unmap
      // would break it. The pages stay mapped and referenced and the reservation stays, handed to the pool,
      // which unmaps them once the capture ended (PagePool::release_deferred): kernels queued earlier may still
      // write through these addresses, so the pages must not be trimmed or handed to another owner before.
      if (pool_->capture_running()) throw CaptureActive("a CUDA graph capture runs");
      wait_for_streams_locked();
    }
    unmap_locked(mapped);
  } catch (const CaptureActive&) {
    DeferredTeardown t{va_, num_pages_ * page_size_, runs(mapped), {}};
    t.pages.reserve(mapped.size());
    for (int64_t s : mapped) t.pages.push_back(table_[s]);
    try {
      pool_->defer_teardown(std::move(t));
      return;
    } catch (...) {  // out of memory recording it: fall through to the old way (drop the references)
    }
    for (int64_t s : mapped)
      if (table_[s] >= 0) pool_->decref(table_[s]);
  } catch (...) {
    // Releasing the reservation below removes the mappings anyway; drop the references by hand.
    for (int64_t s : mapped)
      if (table_[s] >= 0) pool_->decref(table_[s]);
  }
  try {
    pool_->backend().release(va_, num_pages_ * page_size_);
  } catch (...) {
  }
}

size_t VirtualRange::mapped_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_;
}

void VirtualRange::index_out_of_range(int64_t index) const {
  throw InvalidArgument("page index " + std::to_string(index) + " outside the range (" + std::to_string(num_pages_) +
                        " indices)");
}

std::vector<PageId> VirtualRange::home_pages(const std::vector<int64_t>& indices) const {
  // A reservation's home pages are consecutive ids (Backend::home_page): one lookup at construction.
  std::vector<PageId> out;
  out.reserve(indices.size());
  for (int64_t s : indices) out.push_back(home_base_ < 0 ? -1 : home_base_ + s);
  return out;
}

std::vector<IndexRun> VirtualRange::runs(const std::vector<int64_t>& indices) {
  // Sized for the worst case (a run per index) and filled field by field: push_back of a built pair costs a
  // stalled store-to-load forward per element, which showed in profiles of scattered pages.
  std::vector<IndexRun> out(indices.size());
  size_t n = 0;
  for (int64_t s : indices) {
    const size_t i = static_cast<size_t>(s);
    if (n > 0 && out[n - 1].first + out[n - 1].count == i) {
      ++out[n - 1].count;
    } else {
      out[n].first = i;
      out[n].count = 1;
      ++n;
    }
  }
  out.resize(n);
  return out;
}

bool VirtualRange::sort_unique(const std::vector<int64_t>& indices, std::vector<int64_t>& sorted) {
  // Callers mostly pass indices in order (Layout.page_indices): then there is nothing to sort.
  if (std::is_sorted(indices.begin(), indices.end())) {
    return std::adjacent_find(indices.begin(), indices.end()) == indices.end();
  }
  sorted = indices;
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

void VirtualRange::map_runs_or_undo(const std::vector<IndexRun>& index_runs, const std::vector<PageId>& pages) {
  // All runs in one backend call (one lock and one lookup there, however scattered the indices).
  size_t done = 0;
  try {
    pool_->backend().map_runs(va_, index_runs.data(), index_runs.size(), pages.data(), &done);
  } catch (...) {
    // Undo the runs already mapped and drop the references the caller took. A page whose index could not
    // be unmapped keeps its reference (it leaks rather than being handed out again while still mapped).
    size_t pos = 0;
    for (size_t k = 0; k < index_runs.size(); ++k) {
      const size_t n = index_runs[k].count;
      bool still_mapped = false;
      if (k < done) {
        try {
          pool_->backend().unmap(va_ + index_runs[k].first * page_size_, n);
        } catch (...) {
          still_mapped = true;
        }
      }
      if (!still_mapped)
        for (size_t i = pos; i < pos + n; ++i) pool_->decref(pages[i]);
      pos += n;
    }
    throw;
  }
}

void VirtualRange::refuse_mapping_during_capture(const char* call) const {
  // Mapping (and creating the pages to map) calls cuMemCreate / cuMemMap / cuMemSetAccess, which a global-mode
  // capture forbids from any thread. Only the process-wide flag is asked here (an atomic load): map pages
  // before capturing.
  if (pool_->backend().mapping_breaks_capture() && PagePool::capture_flagged()) {
    throw CaptureActive(std::string(call) +
                        ": a CUDA graph capture runs in this process (vpaged.memory.graph_capture): mapping would "
                        "invalidate it; nothing was changed (map pages before capturing)");
  }
}

std::vector<PageId> VirtualRange::map_new(const std::vector<int64_t>& indices) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!indices.empty()) refuse_mapping_during_capture("map_new");
  for (int64_t s : indices) {
    check_index(s);
    if (table_[s] >= 0) throw InvalidArgument("page index " + std::to_string(s) + " is already mapped");
  }
  std::vector<int64_t> copy;
  if (!sort_unique(indices, copy)) throw InvalidArgument("map_new: an index is listed twice");
  const std::vector<int64_t>& sorted = copy.empty() ? indices : copy;
  // Each index's home page where free: such pages need no mapping call on the host (host_backend.cpp).
  std::vector<PageId> pages = pool_->acquire_preferring(home_pages(sorted));  // OutOfPages: nothing changed
  // pages[i] goes to sorted[i]: a run of indices that gets a run of consecutive page ids (the usual case
  // for a pool that is not fragmented) maps in one host call.
  map_runs_or_undo(runs(sorted), pages);
  for (size_t i = 0; i < sorted.size(); ++i) table_[sorted[i]] = pages[i];
  mapped_ += sorted.size();
  if (copy.empty()) return pages;  // the caller's order already
  std::vector<PageId> out;
  out.reserve(indices.size());
  for (int64_t s : indices) out.push_back(table_[s]);
  return out;
}

void VirtualRange::map_shared(const std::vector<int64_t>& indices, const std::vector<PageId>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!indices.empty()) refuse_mapping_during_capture("map_shared");
  if (indices.size() != pages.size()) throw InvalidArgument("map_shared: indices and pages differ in length");
  for (int64_t s : indices) {
    check_index(s);
    if (table_[s] >= 0) throw InvalidArgument("page index " + std::to_string(s) + " is already mapped");
  }
  // Sort by index so runs of consecutive indices map in one backend call (one cuMemSetAccess per run).
  std::vector<size_t> order(indices.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return indices[a] < indices[b]; });
  std::vector<int64_t> sorted_indices;
  std::vector<PageId> sorted_pages;
  for (size_t i : order) {
    if (!sorted_indices.empty() && sorted_indices.back() == indices[i])
      throw InvalidArgument("map_shared: an index is listed twice");
    sorted_indices.push_back(indices[i]);
    sorted_pages.push_back(pages[i]);
  }
  pool_->incref_all(sorted_pages);  // validates every page first; all or nothing
  map_runs_or_undo(runs(sorted_indices), sorted_pages);
  for (size_t i = 0; i < sorted_indices.size(); ++i) table_[sorted_indices[i]] = sorted_pages[i];
  mapped_ += sorted_indices.size();
}

void VirtualRange::unmap(const std::vector<int64_t>& indices) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> copy;
  if (!sort_unique(indices, copy)) throw InvalidArgument("unmap: an index is listed twice");
  for (int64_t s : indices) {
    check_index(s);
    if (table_[s] < 0) throw InvalidArgument("page index " + std::to_string(s) + " is not mapped");
    if (pins_[s] > 0)
      throw ViewsAlive("page index " + std::to_string(s) +
                       " is still read through a live tensor view; drop the view first");
  }
  if (indices.empty()) return;
  wait_for_streams_locked();
  unmap_locked(copy.empty() ? indices : copy);
}

void VirtualRange::wait_for_streams_locked() {
  // Called with mu_ held: the wait is short next to the unmap that follows, and holding the lock keeps
  // another thread from mapping a page into an index between the wait and the unmap. Lock order: range, then
  // pool (the backend's synchronize takes no vpaged lock).
  // A stream capturing a CUDA graph cannot be waited for: cuStreamSynchronize on it fails and, in the global
  // capture mode torch.cuda.graph uses, invalidates the capture (the legacy stream 0 counts as capturing
  // whenever such a capture runs). So every unmap or remap is refused first, with nothing changed and the
  // capture intact; the cache's pool reclaim asks the same question and skips unmapping during a capture.
  // The process-wide capture flag (vpaged.memory.graph_capture) or a global-mode capture the legacy stream
  // reports: any thread's unmap would invalidate that capture too, whatever stream it runs on.
  if (pool_->capture_running()) {
    throw CaptureActive(
        "a CUDA graph capture runs in this process (vpaged.memory.graph_capture, or a global-mode capture): "
        "unmapping or remapping would invalidate it; nothing was changed (do it after the capture ends)");
  }
  for (uintptr_t stream : streams_) {
    if (pool_->backend().capturing(stream)) {
      throw CaptureActive("stream " + std::to_string(stream) +
                          " of this range is capturing a CUDA graph: unmapping or remapping waits for it, which "
                          "a capture forbids; nothing was changed (do it after the capture ends)");
    }
  }
  for (uintptr_t stream : streams_) pool_->backend().synchronize(stream);
}

void VirtualRange::add_stream(uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) streams_.push_back(stream);
}

void VirtualRange::remove_stream(uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(std::remove(streams_.begin(), streams_.end(), stream), streams_.end());
}

void VirtualRange::wait_for_streams() {
  std::lock_guard<std::mutex> lock(mu_);
  wait_for_streams_locked();
}

std::vector<uintptr_t> VirtualRange::streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  return streams_;
}

size_t VirtualRange::pinned_count(const std::vector<int64_t>& indices) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (int64_t s : indices) {
    check_index(s);
    n += pins_[s] > 0;
  }
  return n;
}

void VirtualRange::unmap_locked(const std::vector<int64_t>& indices) {
  // One backend call for all runs of consecutive indices (sorted by the callers); references are dropped only
  // for runs really unmapped, so a failure leaves table and pool consistent. All of them in one pool call: one
  // lock, and the host returns the memory of consecutive pages with one punch.
  const std::vector<IndexRun> index_runs = runs(indices);
  size_t done = 0;
  auto commit = [&] {  // the runs unmapped: out of the table, their references dropped
    std::vector<PageId> pages;
    pages.reserve(indices.size());
    for (size_t k = 0; k < done; ++k) {
      const auto first = table_.begin() + static_cast<std::ptrdiff_t>(index_runs[k].first);
      const auto last = first + static_cast<std::ptrdiff_t>(index_runs[k].count);
      pages.insert(pages.end(), first, last);
      std::fill(first, last, PageId{-1});
      mapped_ -= index_runs[k].count;
    }
    pool_->decref_all(pages);
  };
  try {
    pool_->backend().unmap_runs(va_, index_runs.data(), index_runs.size(), &done);
  } catch (...) {
    commit();
    throw;
  }
  commit();
}

PageId VirtualRange::copy_on_write(int64_t index, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_index(index);
  if (table_[index] < 0) throw InvalidArgument("copy_on_write: page index " + std::to_string(index) + " is not mapped");
  const std::vector<PageId> fresh = pool_->acquire_preferring(home_pages({index}));  // its home page when free
  copy_into_locked({index}, fresh, stream);
  return fresh[0];
}

void VirtualRange::copy_into_locked(const std::vector<int64_t>& indices, const std::vector<PageId>& fresh,
                                    uintptr_t stream) {
  const size_t n = indices.size();
  std::vector<size_t> at(n);
  std::vector<PageId> olds(n);
  for (size_t k = 0; k < n; ++k) {
    at[k] = static_cast<size_t>(indices[k]);
    olds[k] = table_[indices[k]];
  }
  std::unique_ptr<bool[]> lost(new bool[n]());
  try {
    // First the registered streams: one may still be writing a source page (a kernel storing K/V on a
    // stream given to use_stream()), and the copies below, issued on `stream`, would otherwise read the bytes
    // from before that write. The same wait lets kernels still reading the indices finish before the remap.
    wait_for_streams_locked();
    for (size_t k = 0; k < n; ++k) pool_->backend().copy_page(fresh[k], olds[k], stream);
    // The copies read pages that may go back to the pool below: they must be complete first.
    pool_->backend().synchronize(stream);
    pool_->backend().remap(va_, at.data(), olds.data(), fresh.data(), n, lost.get());
  } catch (...) {
    drop_after_failed_remap(at, olds, fresh, lost.get());
    throw;
  }
  for (size_t k = 0; k < n; ++k) table_[at[k]] = fresh[k];
  pool_->decref_all(olds);
}

void VirtualRange::drop_after_failed_remap(const std::vector<size_t>& at, const std::vector<PageId>& olds,
                                           const std::vector<PageId>& pages, const bool* lost) {
  // The backend put every index back but the lost ones (two failures in a row: a device error while
  // undoing). Those are unmapped now, and both their pages keep their references: either may still be
  // mapped there, and handing such a page out again could let a queued kernel read another owner's data.
  std::vector<PageId> release;
  release.reserve(pages.size());
  for (size_t k = 0; k < at.size(); ++k) {
    if (lost[k]) {
      if (olds[k] >= 0) --mapped_;
      table_[at[k]] = -1;
    } else if (pages[k] >= 0) {
      release.push_back(pages[k]);
    }
  }
  pool_->decref_all(release);
}

std::vector<int64_t> VirtualRange::copy_plan_locked(const std::vector<int64_t>& indices) const {
  // Indices listed twice count once (the first time).
  std::vector<int64_t> listed_once;
  const std::vector<int64_t>* order = &indices;
  std::vector<int64_t> scratch;
  if (!sort_unique(indices, scratch)) {
    std::set<int64_t> seen;
    for (int64_t s : indices)
      if (seen.insert(s).second) listed_once.push_back(s);
    order = &listed_once;
  }
  // A page referenced only by listed indices needs one copy fewer than it has indices: the last index listed
  // keeps the original (its reference count is 1 by then). A file or imported page is never the range's to
  // write, however few references it has: every index showing one gets a copy.
  std::vector<int64_t> shared;
  std::vector<int64_t> copy;
  std::map<PageId, size_t> listed;  // page -> listed indices that show it
  for (int64_t s : *order) {
    check_index(s);
    if (table_[s] >= 0 && pool_->is_foreign_page(table_[s])) {
      copy.push_back(s);
    } else if (table_[s] >= 0 && pool_->refcount(table_[s]) > 1) {
      shared.push_back(s);
      ++listed[table_[s]];
    }
  }
  std::map<PageId, size_t> planned;
  for (int64_t s : shared) {
    const PageId page = table_[s];
    const size_t n = listed[page];
    if (static_cast<size_t>(pool_->refcount(page)) > n || ++planned[page] < n) copy.push_back(s);
  }
  return copy;
}

size_t VirtualRange::copies_needed(const std::vector<int64_t>& indices) const {
  std::lock_guard<std::mutex> lock(mu_);
  return copy_plan_locked(indices).size();
}

size_t VirtualRange::make_private(const std::vector<int64_t>& indices, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<int64_t> copy = copy_plan_locked(indices);
  if (copy.empty()) return 0;
  // Every fresh page first (each index's home page where free: on the host it then needs no mapping of its
  // own): running out of pages (or of device memory while creating them) raises OutOfPages with nothing
  // changed. Then all copies and one remap, undone as a whole on failure (the mapping limit included).
  const std::vector<PageId> fresh = pool_->acquire_preferring(home_pages(copy));
  copy_into_locked(copy, fresh, stream);
  return copy.size();
}

void VirtualRange::assign(const std::vector<int64_t>& indices, const std::vector<PageId>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  if (indices.size() != pages.size()) throw InvalidArgument("assign: indices and pages differ in length");
  std::vector<int64_t> scratch;
  if (!sort_unique(indices, scratch)) throw InvalidArgument("assign: an index is listed twice");
  std::vector<size_t> at;
  std::vector<PageId> olds, news, held;
  for (size_t i = 0; i < indices.size(); ++i) {
    check_index(indices[i]);
    const PageId page = pages[i] < 0 ? -1 : pages[i];
    if (table_[indices[i]] == page) continue;
    if (pins_[indices[i]] > 0)
      throw ViewsAlive("assign: page index " + std::to_string(indices[i]) +
                       " is read through a live tensor view; drop the view first");
    at.push_back(static_cast<size_t>(indices[i]));
    olds.push_back(table_[indices[i]]);
    news.push_back(page);
    if (page >= 0) held.push_back(page);
  }
  if (at.empty()) return;
  // A mapped index changes: kernels reading it must be done first.
  if (std::any_of(olds.begin(), olds.end(), [](PageId p) { return p >= 0; })) wait_for_streams_locked();
  pool_->incref_all(held);  // hold every incoming page so none is freed while indices change hands
  pool_->decref_all(remap_held_locked(at, olds, news));
}

std::vector<PageId> VirtualRange::remap_held_locked(const std::vector<size_t>& at, const std::vector<PageId>& olds,
                                                    const std::vector<PageId>& news) {
  std::unique_ptr<bool[]> lost(new bool[at.size() + 1]());
  try {
    if (!at.empty()) pool_->backend().remap(va_, at.data(), olds.data(), news.data(), at.size(), lost.get());
  } catch (...) {
    drop_after_failed_remap(at, olds, news, lost.get());
    throw;
  }
  // Commit: the indices keep the held references to their new pages; the replaced pages lose theirs.
  std::vector<PageId> dropped;
  dropped.reserve(at.size());
  for (size_t k = 0; k < at.size(); ++k) {
    table_[at[k]] = news[k];
    if (olds[k] >= 0) {
      dropped.push_back(olds[k]);
      --mapped_;
    }
    if (news[k] >= 0) ++mapped_;
  }
  return dropped;
}

std::vector<size_t> VirtualRange::in_place_order(const std::vector<int64_t>& src, const std::vector<int64_t>& count,
                                                 const std::vector<int64_t>& tail_index) {
  // Candidates: entries whose tail index shows a private page (tail_index >= 0). Copying into such a page is
  // safe once every entry that reads it has read it: an entry copying its own tail from it can go first, one
  // sharing it (a full page, or a tail that is not copied) cannot. Each candidate reads one tail page, so the
  // "reads the page of" relation is a forest over cycles: an order exists for all but the cycles.
  const size_t n = tail_index.size();
  std::vector<std::pair<int64_t, size_t>> cands;  // (destination tail index, entry), sorted by index
  for (size_t k = 0; k < n; ++k)
    if (tail_index[k] >= 0) cands.emplace_back(tail_index[k], k);
  if (cands.empty()) return {};
  std::sort(cands.begin(), cands.end());
  const size_t none = SIZE_MAX;
  std::vector<char> valid(n, 0);
  std::vector<size_t> source_of(n, none);  // candidate -> the candidate whose page its tail copy reads
  std::vector<size_t> blocked;             // candidates a sharing entry reads
  for (const auto& c : cands) valid[c.second] = 1;
  for (size_t k = 0; k < n; ++k) {
    if (count[k] <= 0) continue;
    const int64_t first = src[k], last = src[k] + count[k] - 1;
    for (auto it = std::lower_bound(cands.begin(), cands.end(), std::make_pair(first, size_t{0}));
         it != cands.end() && it->first <= last; ++it) {
      if (tail_index[k] >= 0 && it->first == last) {
        source_of[k] = it->second;
      } else {
        blocked.push_back(it->second);
      }
    }
  }
  // A candidate that cannot copy shares its source's page: that page's own candidate cannot copy either.
  auto demote = [&](size_t c) {
    while (c != none && valid[c]) {
      valid[c] = 0;
      c = source_of[c];
    }
  };
  for (size_t c : blocked) demote(c);
  // Kahn's order over the valid candidates: a page is written once all copies reading it are done.
  std::vector<size_t> pending(n, 0), ready, order;
  for (const auto& c : cands) {
    const size_t k = c.second;
    if (!valid[k]) continue;
    if (source_of[k] != none && !valid[source_of[k]]) source_of[k] = none;  // reads a page nobody writes
  }
  for (const auto& c : cands)
    if (valid[c.second] && source_of[c.second] != none) ++pending[source_of[c.second]];
  for (const auto& c : cands)
    if (valid[c.second] && pending[c.second] == 0) ready.push_back(c.second);
  while (!ready.empty()) {
    const size_t k = ready.back();
    ready.pop_back();
    order.push_back(k);
    const size_t next = source_of[k];
    if (next != none && --pending[next] == 0) ready.push_back(next);
  }
  return order;  // candidates left out sit on cycles: they share (their sources are cycle members too)
}

size_t VirtualRange::reorder_runs(const std::vector<int64_t>& dst, const std::vector<int64_t>& src,
                                  const std::vector<int64_t>& count, const std::vector<int64_t>& span,
                                  const std::vector<int64_t>& tail, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = dst.size();
  if (src.size() != n || count.size() != n || span.size() != n || tail.size() != n)
    throw InvalidArgument("reorder_runs: the run lists differ in length");
  const int64_t pages = static_cast<int64_t>(num_pages_);
  std::vector<std::pair<int64_t, int64_t>> dst_runs;
  dst_runs.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    if (count[k] < 0 || span[k] < count[k] || span[k] > pages || tail[k] < 0 ||
        tail[k] >= static_cast<int64_t>(page_size_))
      throw InvalidArgument("reorder_runs: a run's count, span or tail is out of range");
    if (span[k] > 0 && (dst[k] < 0 || dst[k] > pages - span[k]))
      throw InvalidArgument("reorder_runs: a destination run lies outside the range");
    if (count[k] > 0 && (src[k] < 0 || src[k] > pages - count[k]))
      throw InvalidArgument("reorder_runs: a source run lies outside the range");
    if (span[k] > 0) dst_runs.emplace_back(dst[k], dst[k] + span[k]);
  }
  std::sort(dst_runs.begin(), dst_runs.end());
  for (size_t i = 1; i < dst_runs.size(); ++i)
    if (dst_runs[i].first < dst_runs[i - 1].second) throw InvalidArgument("reorder_runs: destination runs overlap");

  // What changes, read before anything does. A tail whose destination page is private may take a copy.
  const bool can_copy = pool_->backend().can_copy_page_to();
  std::vector<int64_t> tail_index(n, -1);
  std::vector<PageId> tail_src(n, -1);
  std::vector<size_t> at;
  std::vector<PageId> olds, news;
  for (size_t k = 0; k < n; ++k) {
    for (int64_t j = 0; j < span[k]; ++j) {
      const int64_t index = dst[k] + j;
      const PageId want = j < count[k] ? table_[src[k] + j] : -1;
      const PageId have = table_[index];
      if (want == have) continue;
      if (pins_[index] > 0)
        throw ViewsAlive("reorder: page index " + std::to_string(index) +
                         " is read through a live tensor view; drop the view first");
      // Only a page of the pool's own may be written in place (a file or imported page is read-only).
      if (can_copy && tail[k] > 0 && j == count[k] - 1 && want >= 0 && have >= 0 && pool_->refcount(have) == 1 &&
          !pool_->is_foreign_page(have)) {
        tail_index[k] = index;
        tail_src[k] = want;
        continue;
      }
      at.push_back(static_cast<size_t>(index));
      olds.push_back(have);
      news.push_back(want);
    }
  }
  const std::vector<size_t> order = in_place_order(src, count, tail_index);
  std::vector<char> copied(n, 0);
  for (size_t k : order) copied[k] = 1;
  for (size_t k = 0; k < n; ++k) {
    if (tail_index[k] < 0 || copied[k]) continue;
    at.push_back(static_cast<size_t>(tail_index[k]));  // shares the source's page after all
    olds.push_back(table_[tail_index[k]]);
    news.push_back(tail_src[k]);
  }
  if (at.empty() && order.empty()) return 0;

  wait_for_streams_locked();  // kernels reading (or writing) the pages that change are done first
  std::vector<PageId> held;
  held.reserve(news.size());
  for (PageId p : news)
    if (p >= 0) held.push_back(p);
  pool_->incref_all(held);  // every incoming page is held while indices change hands
  const std::vector<PageId> dropped = remap_held_locked(at, olds, news);
  // The copies come after the remap (which is what can fail for lack of mappings) and before the replaced pages
  // lose their references: a copy may read one of them.
  try {
    for (size_t k : order)
      pool_->backend().copy_page_to(va_ + static_cast<size_t>(tail_index[k]) * page_size_, tail_src[k],
                                    static_cast<size_t>(tail[k]), stream);
    if (!order.empty()) pool_->backend().synchronize(stream);
  } catch (...) {
    pool_->decref_all(dropped);  // a device error: the copied tails' contents are unspecified
    throw;
  }
  pool_->decref_all(dropped);
  return order.size();
}

std::vector<int32_t> VirtualRange::refcounts_at(const std::vector<int64_t>& indices) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> out;
  out.reserve(indices.size());
  for (int64_t s : indices) {
    check_index(s);
    out.push_back(table_[s] >= 0 ? pool_->refcount(table_[s]) : 0);
  }
  return out;
}

PageId VirtualRange::page_at(int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  check_index(index);
  return table_[index];
}

std::vector<PageId> VirtualRange::pages_at(const std::vector<int64_t>& indices) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PageId> out;
  out.reserve(indices.size());
  for (int64_t s : indices) {
    check_index(s);
    out.push_back(table_[s]);
  }
  return out;
}

int32_t VirtualRange::pins_at(int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  check_index(index);
  return pins_[index];
}

bool VirtualRange::is_mapped(size_t offset, size_t len) const {
  if (len == 0) return true;
  if (offset + len > num_pages_ * page_size_ || offset + len < offset) return false;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t s = offset / page_size_; s <= (offset + len - 1) / page_size_; ++s)
    if (table_[s] < 0) return false;
  return true;
}

namespace {
struct ViewContext {
  std::shared_ptr<VirtualRange> owner;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::vector<std::pair<int64_t, int64_t>> pinned;  // inclusive index runs pinned by this view
  DLManagedTensor managed{};
};

void delete_view(DLManagedTensor* self) {
  auto* ctx = static_cast<ViewContext*>(self->manager_ctx);
  for (auto [first, last] : ctx->pinned) ctx->owner->unpin(first, last);
  delete ctx;
}
}  // namespace

// The byte spans a strided view touches, dims taken outermost first (callers order them by stride).
// Index k of dim d covers one block (all the inner dims) `step` bytes after index k-1. When the gap between
// blocks is shorter than a page no page can fall into it, so the union of the blocks is exactly the pages
// touched; otherwise (a view over several sequence indices, or heads stored apart) each block is split
// further. Views over unmapped gaps are thus allowed, and only the pages really read are checked.
void VirtualRange::collect_spans(size_t offset, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                                 size_t dim, size_t itemsize, std::vector<std::pair<size_t, size_t>>& out) const {
  // Every product and sum is checked: a view is refused, never wrapped around, whatever shape it asks for.
  auto mul = [](size_t a, size_t b) {
    size_t r;
    if (__builtin_mul_overflow(a, b, &r)) throw InvalidArgument("view: shape and strides overflow");
    return r;
  };
  auto add = [](size_t a, size_t b) {
    size_t r;
    if (__builtin_add_overflow(a, b, &r)) throw InvalidArgument("view: shape and strides overflow");
    return r;
  };
  size_t inner = 1;  // elements from the first to one past the last element of one block
  for (size_t i = dim + 1; i < shape.size(); ++i)
    inner = add(inner, mul(static_cast<size_t>(shape[i] - 1), static_cast<size_t>(strides[i])));
  const size_t block = mul(inner, itemsize);
  const size_t step = mul(static_cast<size_t>(strides[dim]), itemsize);
  const size_t blocks = static_cast<size_t>(shape[dim]);
  add(add(offset, mul(blocks - 1, step)), block);  // the span's end must be representable
  if (dim + 1 == shape.size() || (blocks > 1 && step < block + page_size_)) {
    out.emplace_back(offset, offset + (blocks - 1) * step + block);
    return;
  }
  for (size_t b = 0; b < blocks; ++b) collect_spans(offset + b * step, shape, strides, dim + 1, itemsize, out);
}

void* VirtualRange::make_dlpack(size_t offset, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                                int dtype_code, int dtype_bits) {
  if (shape.size() != strides.size()) throw InvalidArgument("view: shape and strides differ in length");
  if (shape.empty()) throw InvalidArgument("view: at least one dimension is needed");
  if (!pool_->backend().addressable()) {
    throw InvalidArgument(
        "view: this range is on the accounting backend, which counts pages but holds no "
        "memory; use a host or CUDA pool to read or write K/V");
  }
  const size_t itemsize = static_cast<size_t>(dtype_bits) / 8;
  if (itemsize == 0 || dtype_bits % 8 != 0) throw InvalidArgument("view: unsupported dtype width");
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0 || strides[i] < 0) throw InvalidArgument("view: negative shape or stride");
    if (shape[i] == 0) empty = true;
  }
  std::vector<std::pair<size_t, size_t>> spans;  // byte [lo, hi) the view touches
  if (!empty) collect_spans(offset, shape, strides, 0, itemsize, spans);
  auto ctx = std::make_unique<ViewContext>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t total = num_pages_ * page_size_;
    for (auto [lo, hi] : spans) {
      if (hi > total || lo > hi) throw InvalidArgument("view reaches past the end of the virtual range");
      for (size_t s = lo / page_size_; s <= (hi - 1) / page_size_; ++s) {
        if (table_[s] < 0)
          throw InvalidArgument("view would reach unmapped memory (page index " + std::to_string(s) + ")");
      }
    }
    for (auto [lo, hi] : spans) {
      const int64_t first = static_cast<int64_t>(lo / page_size_);
      const int64_t last = static_cast<int64_t>((hi - 1) / page_size_);
      for (int64_t s = first; s <= last; ++s) ++pins_[s];
      ctx->pinned.emplace_back(first, last);
    }
  }
  ctx->owner = shared_from_this();
  ctx->shape = shape;
  ctx->strides = strides;
  DLTensor& t = ctx->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(va_ + offset);
  t.device.device_type = pool_->backend().dlpack_device_type();
  t.device.device_id = pool_->backend().device_index();
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype.code = static_cast<uint8_t>(dtype_code);
  t.dtype.bits = static_cast<uint8_t>(dtype_bits);
  t.dtype.lanes = 1;
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = delete_view;
  return &ctx.release()->managed;
}

void VirtualRange::unpin(int64_t first, int64_t last) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t s = first; s <= last; ++s) --pins_[s];
}

void VirtualRange::unmap_all_unpinned() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> indices;
  for (size_t s = 0; s < num_pages_; ++s)
    if (table_[s] >= 0 && pins_[s] == 0) indices.push_back(static_cast<int64_t>(s));
  if (indices.empty()) return;
  wait_for_streams_locked();
  unmap_locked(indices);
}

}  // namespace vpaged
