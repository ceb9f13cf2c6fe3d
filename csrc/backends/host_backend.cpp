// Host backend: physical pages live in one memfd, sparse, so RAM is only used by pages that were written.
//
// Note on mappings. Linux allows a process vm.max_map_count mappings (65,530 by default). Mapping every
// page with its own mmap made that limit, not memory, decide how much KV a process could hold (7 GiB of
// Llama-2-7B KV with 64 KiB pages, and a single sequence of the head_major layout). So:
//
// * Each reserved range is ONE shared mapping of its own stretch of the memfd: page index i of a range
//   shows file page `base + i`, the index's "home" page (Backend::home_page). The pool hands an index its
//   home page whenever that page is free, and mapping a home page at its home index is bookkeeping only: no
//   system call. Its memory comes into being when first written.
// * A page that goes free has its hole punched (discard_pages, called by the pool): the memory goes back
//   to the system, the mapping stays, and the page reads as zeros when next handed out.
// * Only an index that shows some other page gets a mapping of its own (MAP_SHARED | MAP_FIXED of that
//   page's file offset): a page shared from another index (fork, prefix hit, reorder), or a fresh page
//   because the index's home is still held by a sharer. Unmapping such an index puts the home mapping back
//   with the same flags, which the kernel merges with its neighbours again. Consecutive indices showing
//   consecutive pages are one mapping.
//
// So a process holds about 1 + 2 * (runs of indices showing a page other than their home) mappings per
// range: the count grows with shared runs, never with pages.
//
// At the limit. The kernel lets a process reach vm.max_map_count + 1 mappings; there every mmap is
// refused, even one that would lower the count, and munmap of part of a mapping keeps the count where it
// is. So putting a home mapping back can fail. The backend tracks the page every index really shows
// (Region::shown), and an unmap that cannot put the home page back leaves the index showing the old page:
// logically unmapped all the same (the range's page table keeps views away), readable memory, no hole.
// Whole mappings are munmapped first where that is what stands in the way (allowed at the limit; it lowers
// the count) and the home page is mapped into the hole they leave. Mapping a page later at an index that
// still shows it needs no call; mapping anything else there raises MappingLimit as any mapping does. Reordering
// and copy-on-write change several indices as one step (remap), which holds a small reserve of mappings so
// that undoing it cannot be refused: it completes or raises MappingLimit with every index as it was. Measured against
// an anonymous mapping + MADV_DONTNEED design in benchmarks/NOTES.md (that one must copy a page into the memfd the
// first time it is shared; this one never copies to share).
//
// The window. Copying into a page that no index shows yet (copy-on-write's fresh page, before the remap) has no
// address to memcpy to, and a pwrite into the file costs several memcpys of the page. So a range's stretch of
// the file is mapped a second time, a 1 GiB chunk at a time on first use, until the range goes: a home page
// whose memory is in place (a kept free page) is written there with a memcpy; a hole is still filled by a
// pwrite, which allocates it without the zeroing a fault would do. The window holds no memory of its own and
// costs one mapping per chunk used, outside the range's addresses.
//
// File pages. A page of another file (a page store's data file, attach_file_pages) gets an id beyond every home
// block, and an index showing it has a mapping of its own like any shared page, MAP_PRIVATE: reads show the file's
// page cache page itself (no copy), a stray write would only make a private copy. Consecutive ids whose bytes
// follow each other in one file are one mapping. Copies out of a file page read the file (pread), copies into one
// are refused. A range that ever shows one is registered with the fault guard until it is released, so that a file
// cut short under it answers a read with zeros instead of SIGBUS.
//
// A logically unmapped index is still readable memory here (its home page, usually a punched hole reading
// zeros): the range's page table, not a fault, keeps views away from it, as before.
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "core/errors.h"
#include "core/fault_guard.h"

namespace vpaged {
namespace {

std::string errno_text(const char* call, int err) { return std::string(call) + " failed: " + std::strerror(err); }

long read_max_map_count() {
  std::ifstream f("/proc/sys/vm/max_map_count");
  long v = -1;
  if (f) f >> v;
  return v;
}

std::string gib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / double(1ull << 30));
  return buf;
}

// What the process can still reserve: the largest gap between its mappings below the 47-bit user
// address limit (mmap without a hint stays below it), and RLIMIT_AS minus what is mapped.
std::string address_space_report(size_t asked) {
  const uint64_t top = 1ull << 47;
  uint64_t prev_end = 1ull << 16, largest = 0, mapped = 0;
  std::ifstream f("/proc/self/maps");
  std::string line;
  while (std::getline(f, line)) {
    uint64_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64, &lo, &hi) != 2) continue;
    mapped += hi - lo;
    if (lo >= top) continue;
    if (lo > prev_end) largest = std::max(largest, lo - prev_end);
    prev_end = std::max(prev_end, hi);
  }
  if (top > prev_end) largest = std::max(largest, top - prev_end);
  std::string out = "reserving " + gib(double(asked)) +
                    " of virtual address space failed: the process can reserve at most " + gib(double(largest)) +
                    " in one piece (user address space 128 TiB, " + gib(double(mapped)) + " already mapped";
  rlimit rl{};
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    out += ", RLIMIT_AS " + gib(double(rl.rlim_cur));
  }
  return out +
         "); a cache reserves max_seqs * max_seq_len tokens of every layer up front: lower max_seqs or "
         "max_seq_len";
}

size_t mapping_count() {
  std::ifstream f("/proc/self/maps");
  std::string line;
  size_t n = 0;
  while (std::getline(f, line)) ++n;
  return n;
}

// mmap failing with ENOMEM on a MAP_FIXED request of a page means the process hit vm.max_map_count: a
// resource limit the caller can act on, not a crash.
[[noreturn]] void throw_mmap_error(const char* call, int err) {
  if (err == ENOMEM) {
    throw MappingLimit(std::string(call) + " failed: the process ran out of memory mappings (vm.max_map_count = " +
                       std::to_string(read_max_map_count()) + ", " + std::to_string(mapping_count()) +
                       " in use); each run of pages shared with another sequence takes up to 2: share less "
                       "(fewer forks / prefix hits at once), use the per_layer or interleaved layout, or raise "
                       "vm.max_map_count");
  }
  throw BackendFailure(errno_text(call, err));
}

constexpr int kRW = PROT_READ | PROT_WRITE;
constexpr int kShared = MAP_SHARED | MAP_NORESERVE;
constexpr int kPrivate = MAP_PRIVATE | MAP_NORESERVE;  // file pages: nothing written reaches the file

class HostBackend final : public Backend {
 public:
  HostBackend(size_t page_size, size_t capacity_pages)
      : page_size_(page_size), capacity_pages_(capacity_pages), next_id_(capacity_pages) {
    const long os_page = sysconf(_SC_PAGESIZE);
    if (page_size == 0 || page_size % static_cast<size_t>(os_page) != 0) {
      throw InvalidArgument("page_size must be a positive multiple of the OS page size (" + std::to_string(os_page) +
                            " bytes), got " + std::to_string(page_size));
    }
    if (capacity_pages == 0) throw InvalidArgument("a page pool needs a capacity of at least one page");
    fd_ = memfd_create("vpaged-pool", MFD_CLOEXEC);
    if (fd_ < 0) throw BackendFailure(errno_text("memfd_create", errno));
    try {
      grow_file(capacity_pages);
    } catch (...) {
      close(fd_);
      throw;
    }
  }

  ~HostBackend() override {
    give_up_reserve_locked();
    for (auto& [va, r] : regions_) unguard_span(r.guard);
    for (const AttachedFile& f : files_)
      if (f.fd >= 0) close(f.fd);
    close(fd_);
  }

  std::string device() const override { return "cpu"; }
  int dlpack_device_type() const override { return 1; /* kDLCPU */ }
  int device_index() const override { return 0; }
  size_t page_size() const override { return page_size_; }
  size_t capacity_pages() const override { return capacity_pages_; }
  // The memfd is sparse: every page exists at no cost.
  size_t created_pages() const override { return capacity_pages_; }
  void create_pages(size_t) override {}
  size_t page_ids() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return next_id_;
  }

  PageId home_page(uintptr_t va) const override {
    std::lock_guard<std::mutex> lock(mu_);
    const Region* r = find_region(va);
    return r ? r->base + static_cast<PageId>((va - r->va) / page_size_) : -1;
  }

  void discard_page(PageId page) override {
    check_page(page);
    punch(page, 1);
  }

  void discard_pages(const PageId* pages, size_t n) noexcept override {
    std::vector<PageId> own;  // a file page is never discarded: its memory is its file's
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!attached_pages_.empty()) {
        try {
          for (size_t i = 0; i < n; ++i)
            if (!is_file_page_locked(pages[i])) own.push_back(pages[i]);
        } catch (...) {
          return;
        }
        pages = own.data();
        n = own.size();
      }
    }
    for_each_id_run(pages, n, [this](PageId first, size_t count) {
      try {
        punch(first, count);
      } catch (...) {
        // The memory stays in use until the page is freed again; the page itself is free either way.
      }
    });
  }

  bool freed_pages_read_zero() const override { return true; }

  // A hole reads as zeros and is the cheapest zeroing there is: no memory is written.
  void zero_pages(const PageId* pages, size_t n, uintptr_t) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < n; ++i) check_writable_locked(pages[i], "zero_pages");
    }
    for_each_id_run(pages, n, [this](PageId first, size_t count) { punch(first, count); });
  }

  uintptr_t reserve(size_t bytes) override {
    if (bytes == 0 || bytes % page_size_ != 0) {
      throw InvalidArgument("reserve: size must be a positive multiple of the page size");
    }
    const size_t count = bytes / page_size_;
    std::lock_guard<std::mutex> lock(mu_);
    const PageId base = take_block(count);
    void* p = MAP_FAILED;
    int err = 0;
    try {
      grow_file(static_cast<size_t>(base) + count);
      p = mmap(nullptr, bytes, kRW, kShared, fd_, offset(base));
      err = errno;
    } catch (const MappingLimit&) {
      give_back_block(base, count);
      throw AddressSpace(address_space_report(bytes));
    } catch (...) {
      give_back_block(base, count);
      throw;
    }
    if (p == MAP_FAILED) {
      give_back_block(base, count);
      // ENOMEM is either limit: the mapping count decides which one this is.
      if (err == ENOMEM && mapping_count() + 2 >= static_cast<size_t>(read_max_map_count())) {
        throw_mmap_error("mmap(reserve)", err);
      }
      if (err == ENOMEM) throw AddressSpace(address_space_report(bytes));
      throw BackendFailure(errno_text("mmap(reserve)", err));
    }
    const uintptr_t va = reinterpret_cast<uintptr_t>(p);
    try {
      regions_.emplace(std::piecewise_construct, std::forward_as_tuple(va), std::forward_as_tuple(va, count, base));
      region_of_id_[base] = va;
    } catch (...) {
      munmap(p, bytes);
      give_back_block(base, count);
      throw;
    }
    return va;
  }

  void release(uintptr_t va, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(va);
    if (it != regions_.end() && it->second.guard >= 0) {
      released_faults_ += span_faults(it->second.guard);
      unguard_span(it->second.guard);  // before the span goes: a later mapping there is someone else's
      it->second.guard = -1;
    }
    if (it != regions_.end() && it->second.holes > 0) {
      // Holes (see put_home_back) may hold someone else's mapping by now: unmap around them.
      const Region& r = it->second;
      for (size_t i = 0; i < r.count;) {
        size_t j = i;
        while (j < r.count && r.is_hole(j) == r.is_hole(i)) ++j;
        if (!r.is_hole(i) && munmap(reinterpret_cast<void*>(r.va + i * page_size_), (j - i) * page_size_) != 0) {
          throw BackendFailure(errno_text("munmap(release)", errno));
        }
        i = j;
      }
    } else if (munmap(reinterpret_cast<void*>(va), bytes) != 0) {
      throw BackendFailure(errno_text("munmap(release)", errno));
    }
    if (it != regions_.end()) {
      // The ids come back for the next range. Any still referenced (a page shared into another range)
      // simply is not free when the new range asks for it as a home page.
      free_blocks_.emplace_back(it->second.base, it->second.count);
      region_of_id_.erase(it->second.base);
      regions_.erase(it);
    }
  }

  void map(uintptr_t va, const PageId* pages, size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) check_page_locked(pages[i]);
    Region& r = region_of(va, n);
    map_locked(r, (va - r.va) / page_size_, pages, n);
  }

  // The indices show their home pages again (no call for indices that already do); the pool punches the
  // pages' holes when their last reference goes. Never fails for lack of mappings: an index whose home
  // cannot be put back keeps showing its old page (see "At the limit" above).
  void unmap(uintptr_t va, size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    Region& r = region_of(va, n);
    if (r.away > 0) put_home_back(r, (va - r.va) / page_size_, n);
  }

  // One lock and one region lookup for all the runs; with home pages (the usual case) mapping is a compare
  // per page and unmapping nothing at all while the range shows no foreign page.
  void map_runs(uintptr_t va, const IndexRun* runs, size_t nruns, const PageId* pages, size_t* done) override {
    *done = 0;
    std::lock_guard<std::mutex> lock(mu_);
    Region& r = region_of_runs(va, runs, nruns);
    size_t total = 0;
    for (size_t k = 0; k < nruns; ++k) total += runs[k].count;
    for (size_t i = 0; i < total; ++i) check_page_locked(pages[i]);
    const size_t base = (va - r.va) / page_size_;
    for (; *done < nruns; ++*done) {
      map_locked(r, base + runs[*done].first, pages, runs[*done].count);
      pages += runs[*done].count;
    }
  }

  void unmap_runs(uintptr_t va, const IndexRun* runs, size_t nruns, size_t* done) override {
    *done = 0;
    std::lock_guard<std::mutex> lock(mu_);
    Region& r = region_of_runs(va, runs, nruns);
    if (r.away > 0) {
      const size_t base = (va - r.va) / page_size_;
      for (size_t k = 0; k < nruns; ++k) put_home_back(r, base + runs[k].first, runs[k].count);
    }
    *done = nruns;
  }

  // One change, undone as a whole on failure. Undoing needs mappings too (an index that went home shows a
  // shared page again: a mapping of its own), and at the limit the kernel refuses them. So before changing
  // anything the backend holds a small reserve of mappings of its own (kUndoReserve tiny PROT_NONE maps;
  // MappingLimit, nothing changed, when the process cannot have them), changes index by index, and on
  // failure gives the reserve back to the kernel and puts every index back as it was, newest first. Each
  // step back recreates a state that existed before (the kernel merges the same neighbours again), which
  // then held the reserve too, so the count stays kUndoReserve below what the kernel allowed: every step
  // back, splitting a mapping or not, is allowed (it needs the count below vm.max_map_count).
  void remap(uintptr_t va, const size_t* indices, const PageId* olds, const PageId* pages, size_t n,
             bool* lost) override {
    std::lock_guard<std::mutex> lock(mu_);
    const Region* found = find_region(va);
    if (found == nullptr || (va - found->va) % page_size_ != 0) {
      throw InvalidArgument("remap outside a reserved range of this backend");
    }
    Region& r = const_cast<Region&>(*found);
    const size_t base = (va - r.va) / page_size_;
    for (size_t k = 0; k < n; ++k) {
      if (indices[k] >= r.count - base) throw InvalidArgument("remap outside a reserved range of this backend");
      if (pages[k] >= 0) check_page_locked(pages[k]);
    }
    top_up_reserve_locked();
    struct Step {
      size_t k;
      size_t at;
      PageId shown;  // what the index showed before the step
    };
    std::vector<Step> journal;
    journal.reserve(n);
    // The changing indices in address order: consecutive ones change with one call each run (map_locked makes
    // one mmap of a run of consecutive pages; a run going home is one mmap of its home stretch), so a beam
    // taking another beam's run of pages costs a call per run, not per page.
    std::vector<size_t> order;
    order.reserve(n);
    for (size_t k = 0; k < n; ++k)
      if (pages[k] != olds[k]) order.push_back(k);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return indices[a] < indices[b]; });
    std::vector<PageId> run_pages;
    try {
      for (size_t i = 0; i < order.size();) {
        const bool to_home = pages[order[i]] < 0;
        size_t j = i + 1;
        while (j < order.size() && indices[order[j]] == indices[order[j - 1]] + 1 && (pages[order[j]] < 0) == to_home) {
          ++j;
        }
        const size_t at = base + indices[order[i]];
        run_pages.clear();
        for (size_t q = i; q < j; ++q) {
          journal.push_back({order[q], base + indices[order[q]], r.shown(base + indices[order[q]])});
          run_pages.push_back(pages[order[q]]);
        }
        if (to_home) {
          put_home_back(r, at,
                        j - i);  // never fails: an index it cannot put home keeps its page, unmapped all the same
        } else {
          map_locked(r, at, run_pages.data(), j - i);
        }
        i = j;
      }
    } catch (...) {
      give_up_reserve_locked();
      for (auto it = journal.rbegin(); it != journal.rend(); ++it) {
        show_exactly(r, it->at, it->shown);
        if (olds[it->k] >= 0 && r.shown(it->at) != olds[it->k]) lost[it->k] = true;
      }
      try {
        top_up_reserve_locked();
      } catch (...) {
        // At the limit: the next remap tops it up first, or refuses with nothing changed.
      }
      throw;
    }
  }

  void copy_page(PageId dst, PageId src, uintptr_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    check_writable_locked(dst, "copy_page");
    check_page_locked(src);
    if (is_file_page_locked(src)) {  // copy-on-write of a store page: read from its file
      const auto [fd, off] = source_locked(src);
      if (char* to = resident_window_locked(dst)) {
        io(true, fd, to, off, page_size_);
      } else {
        std::vector<char> buf(page_size_);
        io(true, fd, buf.data(), off, page_size_);
        io(false, fd_, buf.data(), offset(dst), page_size_);
      }
      return;
    }
    // Where the source shows at its home index (the usual case: the page a fork or a prefix hit shares is its
    // first owner's), the data is read from there (the lock keeps that mapping in place meanwhile): into a page
    // whose memory is in place (a free page the pool kept) by a memcpy through the window, since a pwrite walks
    // the page cache 4 KiB at a time and costs 4-5 memcpys of the page; into a hole by one pwrite, a third
    // faster than copy_file_range (benchmarks/NOTES.md).
    if (const char* from = home_address_locked(src)) {
      if (char* to = resident_window_locked(dst)) {
        std::memcpy(to, from, page_size_);
      } else {
        io(false, fd_, const_cast<char*>(from), offset(dst), page_size_);
      }
      return;
    }
    // In-kernel copy between two stretches of the memfd, wherever (and however often) they are mapped.
    off_t in = offset(src), out = offset(dst);
    size_t left = page_size_;
    while (left > 0) {
      ssize_t got = copy_file_range(fd_, &in, fd_, &out, left, 0);
      if (got <= 0) {
        if (got < 0 && left == page_size_ && (errno == ENOSYS || errno == EXDEV || errno == EINVAL)) {
          copy_through_buffer(dst, src);  // kernels without copy_file_range on one shmem file
          return;
        }
        throw BackendFailure(errno_text("copy_file_range(copy page)", got < 0 ? errno : EIO));
      }
      left -= static_cast<size_t>(got);
    }
  }
  void copy_to_host(PageId src, void* host, uintptr_t stream) override {
    char* const to[1] = {static_cast<char*>(host)};
    copy_pages_to_host(&src, to, 1, stream);
  }
  void copy_from_host(PageId dst, const void* host, uintptr_t stream) override {
    const char* const from[1] = {static_cast<const char*>(host)};
    copy_pages_from_host(&dst, from, 1, stream);
  }

  // A page shown at its home index is read with a memcpy from there (the memory is in place, no system call);
  // others by runs of consecutive pages into consecutive buffers, one pread each.
  void copy_pages_to_host(const PageId* pages, char* const* host, size_t n, uintptr_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) check_page_locked(pages[i]);
    for (size_t i = 0; i < n;) {
      if (const char* from = home_address_locked(pages[i])) {
        std::memcpy(host[i], from, page_size_);
        ++i;
        continue;
      }
      const size_t j = run_end(pages, host, i, n);
      const auto [fd, off] = source_locked(pages[i]);
      io(true, fd, host[i], off, (j - i) * page_size_);
      i = j;
    }
  }

  // A page shown at its home index with its memory in place (a free page the pool kept: PagePool::set_keep_freed;
  // a swap in maps the swapped-out indices' own home pages) is written by a memcpy through that mapping, with no
  // system call per page. The others (punched holes) by runs of consecutive pages from consecutive buffers, one
  // pwrite each: a write into a hole allocates it in the kernel, faster than faulting it in page by page.
  void copy_pages_from_host(const PageId* pages, const char* const* host, size_t n, uintptr_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) check_writable_locked(pages[i], "copy_pages_from_host");
    for (size_t i = 0; i < n;) {
      if (char* to = resident_home_locked(pages[i])) {
        std::memcpy(to, host[i], page_size_);
        ++i;
        continue;
      }
      size_t j = i + 1;
      while (j < n && pages[j] == pages[j - 1] + 1 && host[j] == host[j - 1] + page_size_ &&
             resident_home_locked(pages[j]) == nullptr) {
        ++j;
      }
      io(false, fd_, const_cast<char*>(host[i]), offset(pages[i]), (j - i) * page_size_);
      i = j;
    }
  }

  bool can_copy_page_to() const override { return true; }
  void copy_page_to(uintptr_t dst, PageId src, size_t bytes, uintptr_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    check_page_locked(src);
    const Region* r = find_region(dst);
    if (r == nullptr || bytes > page_size_ || dst + bytes > r->va + r->count * page_size_) {
      throw InvalidArgument("copy_page_to: the destination is not inside a reserved range of this backend");
    }
    if (is_file_page_locked(r->shown((dst - r->va) / page_size_))) {
      throw InvalidArgument("copy_page_to: the destination shows a file page, which is read-only");
    }
    if (const char* from = home_address_locked(src)) {
      std::memcpy(reinterpret_cast<char*>(dst), from, bytes);
    } else {
      const auto [fd, off] = source_locked(src);
      io(true, fd, reinterpret_cast<char*>(dst), off, bytes);
    }
  }
  void synchronize(uintptr_t) override {}

  bool can_attach_file_pages() const override { return true; }

  void attach_file_pages(int fd, const uint64_t* offsets, size_t n, PageId* out) override {
    struct stat st{};
    if (fstat(fd, &st) != 0) throw InvalidArgument(errno_text("attach_file_pages: fstat", errno));
    if (!S_ISREG(st.st_mode)) throw InvalidArgument("attach_file_pages: the descriptor is not a regular file");
    const int mode = fcntl(fd, F_GETFL);
    if (mode < 0 || (mode & O_ACCMODE) == O_WRONLY) {
      throw InvalidArgument("attach_file_pages: the descriptor is not open for reading");
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    for (size_t i = 0; i < n; ++i) {
      if (offsets[i] % os_page_ != 0 || offsets[i] > size || page_size_ > size - offsets[i]) {
        throw InvalidArgument("attach_file_pages: offset " + std::to_string(offsets[i]) + " is not a page of " +
                              std::to_string(page_size_) + " bytes of the file (" + std::to_string(size) +
                              " bytes, pages at multiples of " + std::to_string(os_page_) + ")");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    size_t file = files_.size();
    for (size_t k = 0; k < files_.size(); ++k) {
      if (files_[k].fd >= 0 && files_[k].dev == st.st_dev && files_[k].ino == st.st_ino) file = k;
    }
    const bool new_file = file == files_.size() || files_[file].fd < 0;
    if (new_file) {
      file = files_.size();
      for (size_t k = 0; k < files_.size(); ++k)
        if (files_[k].fd < 0) file = k;
      if (file == files_.size()) files_.emplace_back();
      const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (own < 0) throw BackendFailure(errno_text("attach_file_pages: dup", errno));
      files_[file] = AttachedFile{own, st.st_dev, st.st_ino, 0};
    }
    try {
      attached_pages_.reserve(attached_pages_.size() + n);
    } catch (...) {
      if (files_[file].pages == 0) close_file_locked(file);
      throw;
    }
    for (size_t i = 0; i < n; ++i) {  // nothing below allocates: no failure past here
      PageId id;
      if (!free_file_ids_.empty()) {
        id = free_file_ids_.back();
        free_file_ids_.pop_back();
      } else {
        id = next_id_++;
      }
      attached_pages_.emplace(id, FilePage{file, static_cast<off_t>(offsets[i])});
      out[i] = id;
    }
    files_[file].pages += n;
  }

  void detach_file_page(PageId page) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = attached_pages_.find(page);
    if (it == attached_pages_.end()) return;
    const size_t file = it->second.file;
    attached_pages_.erase(it);
    try {
      free_file_ids_.push_back(page);
    } catch (...) {
      // The id is lost to reuse (a fresh one is taken next time); nothing else is.
    }
    if (--files_[file].pages == 0) close_file_locked(file);
  }

  bool is_file_page(PageId page) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return is_file_page_locked(page);
  }

  size_t file_page_faults() const override {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = released_faults_;
    for (const auto& [va, r] : regions_)
      if (r.guard >= 0) n += span_faults(r.guard);
    return n;
  }

 private:
  // A page of an attached file: which file (files_), and where in it.
  struct FilePage {
    size_t file;
    off_t off;
  };
  struct AttachedFile {
    int fd = -1;  // the backend's own descriptor; -1: the entry is free
    dev_t dev = 0;
    ino_t ino = 0;
    size_t pages = 0;  // ids attached and not detached
  };

  void close_file_locked(size_t file) noexcept {
    close(files_[file].fd);
    files_[file] = AttachedFile{};
  }

  bool is_file_page_locked(PageId page) const { return !attached_pages_.empty() && attached_pages_.count(page) != 0; }

  // Where a page's bytes lie: the pool's memfd at offset(page), or its attached file's page.
  std::pair<int, off_t> source_locked(PageId page) const {
    if (!attached_pages_.empty()) {
      auto it = attached_pages_.find(page);
      if (it != attached_pages_.end()) return {files_[it->second.file].fd, it->second.off};
    }
    return {fd_, offset(page)};
  }

  // Whether page b's bytes follow page a's in one file, so that one mapping or one read covers both. Consecutive
  // ids of the pool's memfd always do; a file page only with the next page of its own file.
  bool follows_locked(PageId a, PageId b) const {
    if (b != a + 1) return false;
    if (attached_pages_.empty()) return true;
    auto ia = attached_pages_.find(a), ib = attached_pages_.find(b);
    if (ia == attached_pages_.end() && ib == attached_pages_.end()) return true;
    if (ia == attached_pages_.end() || ib == attached_pages_.end()) return false;
    return ia->second.file == ib->second.file && ib->second.off == ia->second.off + static_cast<off_t>(page_size_);
  }

  void check_writable_locked(PageId page, const char* call) const {
    check_page_locked(page);
    if (is_file_page_locked(page)) {
      throw InvalidArgument(std::string(call) + ": page " + std::to_string(page) +
                            " is a file page, which is read-only");
    }
  }

  // What the page indices of one reserved range show. Stored as the difference from the home page, so
  // that a fresh range is all zeros: calloc'd, memory is only used for the parts that ever leave home.
  struct Region {
    static constexpr PageId kHole = INT64_MIN;  // nothing mapped there (see put_home_back)

    Region(uintptr_t va_, size_t count_, PageId base_)
        : va(va_), count(count_), base(base_), delta(static_cast<PageId*>(std::calloc(count_, sizeof(PageId)))) {
      if (delta == nullptr) throw std::bad_alloc();
    }
    ~Region() {
      std::free(delta);
      for (const auto& chunk : window)
        if (chunk.first != nullptr) munmap(chunk.first, chunk.second);
    }
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;

    PageId home(size_t i) const { return base + static_cast<PageId>(i); }
    bool is_hole(size_t i) const { return delta[i] == kHole; }
    // The page index i shows; -1 for a hole.
    PageId shown(size_t i) const { return delta[i] == kHole ? -1 : home(i) + delta[i]; }
    void set_shown(size_t i, PageId page) {
      const PageId d = page < 0 ? kHole : page - home(i);
      away += (d != 0) - (delta[i] != 0);
      holes += (d == kHole) - (delta[i] == kHole);
      delta[i] = d;
    }

    uintptr_t va;
    size_t count;  // page indices
    PageId base;   // home page of index 0
    PageId* delta;
    size_t away = 0;   // indices not showing their home page (unmap has nothing to do while this is 0)
    size_t holes = 0;  // indices with nothing mapped
    int guard = -1;    // its fault guard slot, once it showed a file page (until release)
    std::vector<std::pair<char*, size_t>> window;  // its window's chunks (resident_window_locked), once made
  };

  // A range about to show a file page goes under the fault guard (until it is released).
  void guard_region_locked(Region& r) {
    if (r.guard >= 0) return;
    r.guard = guard_span(r.va, r.va + r.count * page_size_);
    if (r.guard < 0) {
      throw MappingLimit("cannot map a file page: " + std::to_string(kMaxGuardedSpans) +
                         " ranges with file pages (or guarded ledgers) are live in this process already");
    }
  }

  off_t offset(PageId page) const { return static_cast<off_t>(page) * static_cast<off_t>(page_size_); }

  void check_page(PageId page) const {
    std::lock_guard<std::mutex> lock(mu_);
    check_page_locked(page);
  }
  void check_page_locked(PageId page) const {
    if (page < 0 || page >= next_id_) throw InvalidArgument("page id " + std::to_string(page) + " out of range");
  }

  const Region* find_region(uintptr_t va) const {
    auto it = regions_.upper_bound(va);
    if (it == regions_.begin()) return nullptr;
    --it;
    const Region& r = it->second;
    return va < r.va + r.count * page_size_ ? &r : nullptr;
  }

  Region& region_of(uintptr_t va, size_t n) {
    const Region* r = find_region(va);
    if (r == nullptr || (va - r->va) % page_size_ != 0 || (va - r->va) / page_size_ + n > r->count) {
      throw InvalidArgument("map/unmap outside a reserved range of this backend");
    }
    return const_cast<Region&>(*r);
  }

  // The region holding every run of indices counted from va.
  Region& region_of_runs(uintptr_t va, const IndexRun* runs, size_t nruns) {
    const Region* r = find_region(va);
    if (r == nullptr || (va - r->va) % page_size_ != 0) {
      throw InvalidArgument("map/unmap outside a reserved range of this backend");
    }
    const size_t room = r->count - (va - r->va) / page_size_;  // indices from va to the region's end
    for (size_t k = 0; k < nruns; ++k) {
      if (runs[k].first > room || runs[k].count > room - runs[k].first) {
        throw InvalidArgument("map/unmap outside a reserved range of this backend");
      }
    }
    return const_cast<Region&>(*r);
  }

  // Indices [first, first + n) show pages[0..n). All or nothing: on failure the indices mapped so far go back
  // to being unmapped (showing whatever they can: see unmap) and the error is rethrown.
  void map_locked(Region& r, size_t first, const PageId* pages, size_t n) {
    size_t done = 0;
    try {
      while (done < n) {
        const size_t at = first + done;
        // Usually nothing to do: an unmapped index shows its home page, and that is the page it gets.
        if (r.shown(at) == pages[done]) {
          ++done;
          continue;
        }
        // A run of consecutive page ids is one file stretch: one mapping.
        size_t run = 1;
        while (done + run < n && follows_locked(pages[done + run - 1], pages[done + run]) &&
               r.shown(at + run) != pages[done + run] && r.is_hole(at + run) == r.is_hole(at)) {
          ++run;
        }
        if (pages[done] == r.home(at)) {
          if (!put_home_back(r, at, run)) {
            throw_mmap_error("mmap(map home page)", ENOMEM);
          }
        } else {
          show_pages(r, at, pages[done], run);
        }
        done += run;
      }
    } catch (...) {
      put_home_back(r, first, done);
      throw;
    }
  }

  // The page shown just before index i (at index 0: by the range right below, if it is one of ours and
  // adjoins), -1 if none: a mapping of consecutive file pages may continue across the boundary.
  PageId shown_before(const Region& r, size_t i) const {
    if (i > 0) return r.shown(i - 1);
    const Region* below = r.va >= page_size_ ? find_region(r.va - page_size_) : nullptr;
    return below ? below->shown(below->count - 1) : -1;
  }
  PageId shown_after(const Region& r, size_t i) const {
    if (i + 1 < r.count) return r.shown(i + 1);
    const Region* above = find_region(r.va + r.count * page_size_);
    return above && above->va == r.va + r.count * page_size_ ? above->shown(0) : -1;
  }

  // Map `count` consecutive pages from `page` at indices [at, at + count) (MAP_FIXED over what they show;
  // into a hole only with MAP_FIXED_NOREPLACE, never over a mapping that is not ours).
  void show_pages(Region& r, size_t at, PageId page, size_t count) {
    void* want = reinterpret_cast<void*>(r.va + at * page_size_);
    const int fixed = r.is_hole(at) ? MAP_FIXED_NOREPLACE : MAP_FIXED;
    const auto [fd, off] = source_locked(page);
    if (fd != fd_) guard_region_locked(r);
    void* got = mmap(want, count * page_size_, kRW, (fd != fd_ ? kPrivate : kShared) | fixed, fd, off);
    ++map_calls_;
    if (got != want) {
      if (got != MAP_FAILED) munmap(got, count * page_size_);  // a kernel without NOREPLACE took it as a hint
      throw_mmap_error("mmap(map shared page)", got == MAP_FAILED ? errno : EEXIST);
    }
    for (size_t k = 0; k < count; ++k) r.set_shown(at + k, page + static_cast<PageId>(k));
  }

  // Put the home pages back at the indices among [at, at + n) that show something else. True when all of
  // them show their home afterwards; false when the mapping limit (or another refusal) left some showing
  // their old page, which stays consistent: Region::shown says what they show.
  bool put_home_back(Region& r, size_t at, size_t n) noexcept {
    const size_t end = at + n;
    bool all = true;
    for (size_t i = at; i < end;) {
      if (r.shown(i) == r.home(i)) {
        ++i;
        continue;
      }
      size_t j = i + 1;
      while (j < end && r.shown(j) != r.home(j)) ++j;
      all &= home_run(r, i, j);
      i = j;
    }
    return all;
  }

  bool try_map_home(Region& r, size_t i, size_t j, int fixed) noexcept {
    void* addr = reinterpret_cast<void*>(r.va + i * page_size_);
    ++unmap_calls_;
    void* got = mmap(addr, (j - i) * page_size_, kRW, kShared | fixed, fd_, offset(r.home(i)));
    if (got != addr) {
      if (got != MAP_FAILED) munmap(got, (j - i) * page_size_);
      return false;
    }
    for (size_t k = i; k < j; ++k) r.set_shown(k, r.home(k));
    return true;
  }

  // Indices [i, j), none of them at home: one mmap of the home stretch over them, as a rule.
  bool home_run(Region& r, size_t i, size_t j) noexcept {
    bool has_hole = false;
    for (size_t k = i; k < j && !has_hole; ++k) has_hole = r.is_hole(k);
    if (!has_hole && try_map_home(r, i, j, MAP_FIXED)) return true;
    // Refused: at the limit (vm.max_map_count + 1 mappings) every mmap is, even one lowering the count.
    // munmap of whole mappings is allowed and lowers it, after which the home stretch can be mapped into
    // the hole (MAP_FIXED_NOREPLACE: if another thread's mmap took the hole meanwhile, it is left alone
    // and the indices are marked as holes). Only stretches that are certainly whole mappings qualify:
    // consecutive pages that do not continue past the stretch. Part of a mapping would be split by
    // munmap, keeping the count at the limit, and the home page could not go back (a hole in the range).
    for (size_t a = i; a < j;) {
      size_t b = a + 1;
      if (r.is_hole(a)) {
        while (b < j && r.is_hole(b)) ++b;
        try_map_home(r, a, b, MAP_FIXED_NOREPLACE);
        a = b;
        continue;
      }
      while (b < j && !r.is_hole(b) && r.shown(b) == r.shown(b - 1) + 1) ++b;
      const bool whole = shown_before(r, a) + 1 != r.shown(a) && r.shown(b - 1) + 1 != shown_after(r, b - 1);
      if (whole && munmap(reinterpret_cast<void*>(r.va + a * page_size_), (b - a) * page_size_) == 0) {
        if (!try_map_home(r, a, b, MAP_FIXED_NOREPLACE)) {
          for (size_t k = a; k < b; ++k) r.set_shown(k, -1);
        }
      }
      a = b;
    }
    // What is left is part of larger mappings: with the count lowered, one more try.
    bool all = true;
    for (size_t a = i; a < j;) {
      if (r.shown(a) == r.home(a)) {
        ++a;
        continue;
      }
      size_t b = a + 1;
      while (b < j && r.shown(b) != r.home(b) && r.is_hole(b) == r.is_hole(a)) ++b;
      all &= try_map_home(r, a, b, r.is_hole(a) ? MAP_FIXED_NOREPLACE : MAP_FIXED);
      a = b;
    }
    return all;
  }

  // Make index `at` show `page` (-1: nothing) exactly, with one call: for undoing a remap step.
  bool show_exactly(Region& r, size_t at, PageId page) noexcept {
    if (r.shown(at) == page) return true;
    void* addr = reinterpret_cast<void*>(r.va + at * page_size_);
    if (page < 0) {
      if (munmap(addr, page_size_) != 0) return false;
      r.set_shown(at, -1);
      return true;
    }
    const auto [fd, off] = source_locked(page);  // a file page here was guarded when it was first shown
    ++map_calls_;
    void* got = mmap(addr, page_size_, kRW,
                     (fd != fd_ ? kPrivate : kShared) | (r.is_hole(at) ? MAP_FIXED_NOREPLACE : MAP_FIXED), fd, off);
    if (got != addr) {
      if (got != MAP_FAILED) munmap(got, page_size_);
      return false;
    }
    r.set_shown(at, page);
    return true;
  }

  // The reserve remap() spends when it must undo. One OS page of the pool's file each, PROT_NONE: never
  // touched, and never merged with a neighbour (no range maps the file without access, and two of them map
  // the same offset, not consecutive ones).
  void top_up_reserve_locked() {
    while (reserve_.size() < kUndoReserve) {
      void* p = mmap(nullptr, os_page_, PROT_NONE, MAP_SHARED | MAP_NORESERVE, fd_, 0);
      if (p == MAP_FAILED) throw_mmap_error("mmap(reserve for undoing a remap)", errno);
      reserve_.push_back(p);
    }
  }
  void give_up_reserve_locked() noexcept {
    for (void* p : reserve_) munmap(p, os_page_);
    reserve_.clear();
  }

  void punch(PageId first, size_t count) {
    // The hole reads as zeros and takes the window's page table entries with it (resident_window_locked).
    {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t end = std::min(window_written_.size(), static_cast<size_t>(first) + count);
      for (size_t id = static_cast<size_t>(first); id < end; ++id) window_written_[id] = false;
    }
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset(first),
                  static_cast<off_t>(count * page_size_)) != 0) {
      throw BackendFailure(errno_text("fallocate(PUNCH_HOLE)", errno));
    }
  }

  template <typename F>
  static void for_each_id_run(const PageId* pages, size_t n, F&& f) {
    if (n == 1) {  // the common case of a page freed on its own: no copy, no sort
      f(pages[0], size_t{1});
      return;
    }
    std::vector<PageId> sorted;
    if (!std::is_sorted(pages, pages + n)) {  // pages freed in index order usually come sorted (home pages)
      sorted.assign(pages, pages + n);
      std::sort(sorted.begin(), sorted.end());
      pages = sorted.data();
    }
    size_t i = 0;
    while (i < n) {
      size_t j = i + 1;
      while (j < n && pages[j] <= pages[j - 1] + 1) ++j;
      f(pages[i], static_cast<size_t>(pages[j - 1] - pages[i] + 1));
      i = j;
    }
  }

  // A block of `count` consecutive ids for a new range: a released block that fits, else fresh ids.
  PageId take_block(size_t count) {
    for (auto it = free_blocks_.begin(); it != free_blocks_.end(); ++it) {
      if (it->second < count) continue;
      const PageId base = it->first;
      if (it->second == count) {
        free_blocks_.erase(it);
      } else {
        it->first += static_cast<PageId>(count);
        it->second -= count;
      }
      return base;
    }
    const PageId base = next_id_;
    next_id_ += static_cast<PageId>(count);
    return base;
  }

  // The ids of a reservation that failed: at the end they go back to the end (a failed huge reservation must
  // not leave the pool sizing its tables to it). Released ranges' ids go to free_blocks_ instead: one of
  // their pages may still be mapped elsewhere, and its id must stay valid.
  void give_back_block(PageId base, size_t count) {
    if (base + static_cast<PageId>(count) == next_id_) {
      next_id_ = base;
    } else {
      free_blocks_.emplace_back(base, count);
    }
  }

  void grow_file(size_t pages) {
    if (pages <= file_pages_) return;
    size_t bytes = 0;
    if (__builtin_mul_overflow(pages, page_size_, &bytes) || bytes > static_cast<size_t>(INT64_MAX)) {
      throw MappingLimit("the pool's file cannot grow to " + std::to_string(pages) + " pages");
    }
    if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      if (err == EFBIG || err == EINVAL) throw MappingLimit(errno_text("ftruncate(pool file)", err));
      throw BackendFailure(errno_text("ftruncate(pool file)", err));
    }
    file_pages_ = pages;
  }

  void io(bool read, int fd, char* host, off_t off, size_t bytes) {
    size_t done = 0;
    while (done < bytes) {
      ssize_t got = read ? pread(fd, host + done, bytes - done, off + static_cast<off_t>(done))
                         : pwrite(fd, host + done, bytes - done, off + static_cast<off_t>(done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) throw BackendFailure(errno_text(read ? "pread(page)" : "pwrite(page)", got < 0 ? errno : EIO));
      done += static_cast<size_t>(got);
    }
  }

  void copy_through_buffer(PageId dst, PageId src) {
    std::vector<char> buf(page_size_);
    io(true, fd_, buf.data(), offset(src), page_size_);
    io(false, fd_, buf.data(), offset(dst), page_size_);
  }

  // The address where page `page` shows at its home index, nullptr when that index shows another page (or the
  // page is no range's home). Called with mu_ held.
  const char* home_address_locked(PageId page) const {
    size_t i = 0;
    const Region* r = home_region_locked(page, &i);
    if (r == nullptr || r->shown(i) != page) return nullptr;
    return reinterpret_cast<const char*>(r->va + i * page_size_);
  }

  // The live range whose block of home pages holds `page`, and the page's index there in *index; nullptr where
  // no live range's does. Called with mu_ held.
  const Region* home_region_locked(PageId page, size_t* index) const {
    auto it = region_of_id_.upper_bound(page);
    if (it == region_of_id_.begin()) return nullptr;
    const Region& r = regions_.at(std::prev(it)->second);
    const size_t i = static_cast<size_t>(page - r.base);
    if (i >= r.count) return nullptr;
    *index = i;
    return &r;
  }
  Region* home_region_locked(PageId page, size_t* index) {
    return const_cast<Region*>(static_cast<const HostBackend*>(this)->home_region_locked(page, index));
  }

  // Whether every OS page of the page at `at` is resident (mincore). Called with mu_ held (mincore_buf_ is the
  // pool's scratch).
  bool resident_locked(const char* at) {
    mincore_buf_.resize(page_size_ / os_page_);
    if (mincore(const_cast<char*>(at), page_size_, mincore_buf_.data()) != 0) return false;
    for (unsigned char b : mincore_buf_)
      if ((b & 1) == 0) return false;
    return true;
  }

  // The address where `page` shows at its home index when its memory is resident, else nullptr. Called with
  // mu_ held.
  char* resident_home_locked(PageId page) {
    const char* at = home_address_locked(page);
    return at != nullptr && resident_locked(at) ? const_cast<char*>(at) : nullptr;
  }

  // The address of `page` in its range's window (a second mapping of the range's stretch of the pool's file,
  // made a 1 GiB chunk at a time on first use and unmapped with the range) when every OS page of it is
  // resident, else nullptr; nullptr too for a page that is no live range's home, or when the chunk cannot be
  // mapped (at the mapping limit: the caller's pwrite then does the work). Unlike a range's index, a window
  // address always shows the same page, so the page table entries a write there made stay valid until the
  // page's hole is punched (the kernel then drops them in every mapping): a kept page written through the
  // window before is written again at memcpy speed, with no fault. Called with mu_ held.
  char* resident_window_locked(PageId page) {
    size_t i = 0;
    Region* found = home_region_locked(page, &i);
    if (found == nullptr) return nullptr;
    Region& r = *found;
    const size_t chunk_pages = std::max<size_t>(1, (size_t{1} << 30) / page_size_);
    const size_t c = i / chunk_pages;
    if (r.window.empty()) r.window.assign((r.count + chunk_pages - 1) / chunk_pages, {nullptr, 0});
    if (r.window[c].first == nullptr) {
      const size_t bytes = std::min(chunk_pages, r.count - c * chunk_pages) * page_size_;
      void* p = mmap(nullptr, bytes, kRW, kShared, fd_, offset(r.home(c * chunk_pages)));
      if (p == MAP_FAILED) return nullptr;
      r.window[c] = {static_cast<char*>(p), bytes};
    }
    char* at = r.window[c].first + (i - c * chunk_pages) * page_size_;
    // A page written here before and not punched since is in place: no mincore (half a memcpy of the page).
    const size_t id = static_cast<size_t>(page);
    if (id < window_written_.size() && window_written_[id]) return at;
    if (!resident_locked(at)) return nullptr;
    if (id >= window_written_.size()) window_written_.resize(std::max(id + 1, file_pages_), false);
    window_written_[id] = true;  // the caller writes it now
    return at;
  }

  // The end of the run starting at i: consecutive page ids whose buffers follow each other.
  template <typename Ptr>
  size_t run_end(const PageId* pages, const Ptr* host, size_t i, size_t n) const {
    size_t j = i + 1;
    while (j < n && follows_locked(pages[j - 1], pages[j]) && host[j] == host[j - 1] + page_size_) ++j;
    return j;
  }

  // Mappings held back for undoing a remap at the mapping limit: 2 would do (a step back that splits a
  // mapping in the middle needs the count below the limit); 4 leave room for mappings others make meanwhile.
  static constexpr size_t kUndoReserve = 4;

  size_t page_size_;
  size_t capacity_pages_;
  size_t os_page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> mincore_buf_;  // resident_locked's scratch (under mu_)
  int fd_ = -1;
  std::vector<void*> reserve_;        // see top_up_reserve_locked
  std::vector<bool> window_written_;  // per page id: written through the window, not punched since
  mutable std::mutex mu_;             // regions, id blocks, file size, reserve, window
  PageId next_id_;
  size_t file_pages_ = 0;
  std::map<uintptr_t, Region> regions_;
  std::map<PageId, uintptr_t> region_of_id_;  // first home page id of a region -> its address (home_address)
  std::vector<std::pair<PageId, size_t>> free_blocks_;
  // File pages (attach_file_pages): id -> where; the files, by their own descriptor; ids detached, for reuse (never
  // a range's: free_blocks_ ids may still be referenced as memfd pages); faults in ranges released since.
  std::unordered_map<PageId, FilePage> attached_pages_;
  std::vector<AttachedFile> files_;
  std::vector<PageId> free_file_ids_;
  size_t released_faults_ = 0;
};

}  // namespace

std::shared_ptr<Backend> make_host_backend(size_t page_size, size_t capacity_pages) {
  return std::make_shared<HostBackend>(page_size, capacity_pages);
}

}  // namespace vpaged
