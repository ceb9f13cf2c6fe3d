// Host backend: physical pages live in one memfd, sparse, so RAM is only used by pages that were written.
//
// Note on mappings. Linux allows a process vm.max_map_count mappings (65,530 by default). Mapping every
// page with its own mmap made that limit, not memory, decide how much KV a process could hold (7 GiB of
// Llama-2-7B KV with 64 KiB pages, and a single sequence of the head_major layout). So:
//
// * Each reserved range is ONE shared mapping of its own stretch of the memfd: slot s of a range shows
//   file page `base + s`, the slot's "home" page (Backend::home_page). The pool hands a slot its home page
//   whenever that page is free, and mapping a home page at its home slot is bookkeeping only: no system
//   call. Its memory comes into being when first written.
// * A page that goes free has its hole punched (discard_pages, called by the pool): the memory goes back
//   to the system, the mapping stays, and the page reads as zeros when next handed out.
// * Only a slot that shows some other page gets a mapping of its own (MAP_SHARED | MAP_FIXED of that
//   page's file offset): a page shared from another slot (fork, prefix hit, reorder), or a fresh page
//   because the slot's home is still held by a sharer. Unmapping such a slot puts the home mapping back
//   with the same flags, which the kernel merges with its neighbours again. Consecutive slots showing
//   consecutive pages are one mapping.
//
// So a process holds about 1 + 2 * (runs of slots showing a page other than their home) mappings per
// range: the count grows with shared runs, never with pages. Measured against an anonymous mapping +
// MADV_DONTNEED design in benchmarks/NOTES.md (that one must copy a page into the memfd the first time it
// is shared; this one never copies to share).
//
// A logically unmapped slot is still readable memory here (its home page, usually a hole reading zeros):
// the range's page table, not a fault, keeps views away from it, as before.
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"
#include "errors.h"

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

  ~HostBackend() override { close(fd_); }

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
    for (size_t i = 0; i < n; ++i) check_page(pages[i]);
    for_each_id_run(pages, n, [this](PageId first, size_t count) { punch(first, count); });
  }

  uintptr_t reserve(size_t bytes) override {
    if (bytes == 0 || bytes % page_size_ != 0) {
      throw InvalidArgument("reserve: size must be a positive multiple of the page size");
    }
    const size_t slots = bytes / page_size_;
    std::lock_guard<std::mutex> lock(mu_);
    const PageId base = take_block(slots);
    void* p = MAP_FAILED;
    int err = 0;
    try {
      grow_file(static_cast<size_t>(base) + slots);
      p = mmap(nullptr, bytes, kRW, kShared, fd_, offset(base));
      err = errno;
    } catch (const MappingLimit&) {
      give_back_block(base, slots);
      throw AddressSpace(address_space_report(bytes));
    } catch (...) {
      give_back_block(base, slots);
      throw;
    }
    if (p == MAP_FAILED) {
      give_back_block(base, slots);
      // ENOMEM is either limit: the mapping count decides which one this is.
      if (err == ENOMEM && mapping_count() + 2 >= static_cast<size_t>(read_max_map_count())) {
        throw_mmap_error("mmap(reserve)", err);
      }
      if (err == ENOMEM) throw AddressSpace(address_space_report(bytes));
      throw BackendFailure(errno_text("mmap(reserve)", err));
    }
    const uintptr_t va = reinterpret_cast<uintptr_t>(p);
    regions_.emplace(va, Region{va, slots, base, std::vector<uint8_t>(slots, 0)});
    return va;
  }

  void release(uintptr_t va, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (munmap(reinterpret_cast<void*>(va), bytes) != 0) {
      throw BackendFailure(errno_text("munmap(release)", errno));
    }
    auto it = regions_.find(va);
    if (it != regions_.end()) {
      // The ids come back for the next range. Any still referenced (a page shared into another range)
      // simply is not free when the new range asks for it as a home page.
      free_blocks_.emplace_back(it->second.base, it->second.slots);
      regions_.erase(it);
    }
  }

  void map(uintptr_t va, const PageId* pages, size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) check_page_locked(pages[i]);
    Region& r = region_of(va, n);
    const size_t first = (va - r.va) / page_size_;
    size_t done = 0;
    try {
      while (done < n) {
        // A run of consecutive page ids is one file stretch: one mapping (or none, at home).
        size_t run = 1;
        while (done + run < n && pages[done + run] == pages[done] + static_cast<PageId>(run)) ++run;
        const size_t slot = first + done;
        if (pages[done] == r.base + static_cast<PageId>(slot)) {
          show_home(r, slot, run);  // usually nothing to do: an unmapped slot already shows its home
        } else {
          void* want = reinterpret_cast<void*>(r.va + slot * page_size_);
          void* got = mmap(want, run * page_size_, kRW, kShared | MAP_FIXED, fd_, offset(pages[done]));
          ++map_calls_;
          if (got == MAP_FAILED) throw_mmap_error("mmap(map shared page)", errno);
          std::fill_n(r.foreign.begin() + static_cast<ptrdiff_t>(slot), run, 1);
        }
        done += run;
      }
    } catch (...) {
      try {
        show_home(r, first, done);
      } catch (...) {
      }
      throw;
    }
  }

  // The slots show their home pages again (no call for slots that already do); the pool punches the
  // pages' holes when their last reference goes.
  void unmap(uintptr_t va, size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    Region& r = region_of(va, n);
    show_home(r, (va - r.va) / page_size_, n);
  }

  void copy_page(PageId dst, PageId src, uintptr_t) override {
    check_page(dst);
    check_page(src);
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
  void copy_to_host(PageId src, void* host, uintptr_t) override {
    check_page(src);
    io(true, static_cast<char*>(host), offset(src));
  }
  void copy_from_host(PageId dst, const void* host, uintptr_t) override {
    check_page(dst);
    io(false, const_cast<char*>(static_cast<const char*>(host)), offset(dst));
  }
  void synchronize(uintptr_t) override {}

 private:
  struct Region {
    uintptr_t va;
    size_t slots;
    PageId base;                   // home page of slot 0
    std::vector<uint8_t> foreign;  // 1 where the slot shows a page other than its home (its own mapping)
  };

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
    return va < r.va + r.slots * page_size_ ? &r : nullptr;
  }

  Region& region_of(uintptr_t va, size_t n) {
    const Region* r = find_region(va);
    if (r == nullptr || (va - r->va) % page_size_ != 0 || (va - r->va) / page_size_ + n > r->slots) {
      throw InvalidArgument("map/unmap outside a reserved range of this backend");
    }
    return const_cast<Region&>(*r);
  }

  // Put the home mapping back over the foreign slots among [slot, slot + n).
  void show_home(Region& r, size_t slot, size_t n) {
    size_t i = slot;
    const size_t end = slot + n;
    while (i < end) {
      if (!r.foreign[i]) {
        ++i;
        continue;
      }
      size_t j = i;
      while (j < end && r.foreign[j]) ++j;
      remap_home(r, i, j - i);
      std::fill(r.foreign.begin() + static_cast<ptrdiff_t>(i), r.foreign.begin() + static_cast<ptrdiff_t>(j), 0);
      i = j;
    }
  }

  void remap_home(const Region& r, size_t slot, size_t n) {
    void* addr = reinterpret_cast<void*>(r.va + slot * page_size_);
    const size_t len = n * page_size_;
    const off_t off = offset(r.base + static_cast<PageId>(slot));
    ++unmap_calls_;
    if (mmap(addr, len, kRW, kShared | MAP_FIXED, fd_, off) != MAP_FAILED) return;
    int err = errno;
    // At vm.max_map_count every mmap is refused, even one that lowers the count (the merge happens after
    // the check). munmap of whole mappings is not refused; the hole then takes the home mapping again.
    if (err != ENOMEM || munmap(addr, len) != 0) throw_mmap_error("mmap(unmap page)", err);
    if (mmap(addr, len, kRW, kShared | MAP_FIXED_NOREPLACE, fd_, off) != addr) {
      // The hole stays unmapped (reads fault): only these slots' reservation is lost.
      throw BackendFailure(errno_text("mmap(home after unmap)", errno));
    }
  }

  void punch(PageId first, size_t count) {
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset(first),
                  static_cast<off_t>(count * page_size_)) != 0) {
      throw BackendFailure(errno_text("fallocate(PUNCH_HOLE)", errno));
    }
  }

  template <typename F>
  static void for_each_id_run(const PageId* pages, size_t n, F&& f) {
    std::vector<PageId> ids(pages, pages + n);
    std::sort(ids.begin(), ids.end());
    size_t i = 0;
    while (i < ids.size()) {
      size_t j = i + 1;
      while (j < ids.size() && ids[j] <= ids[j - 1] + 1) ++j;
      f(ids[i], static_cast<size_t>(ids[j - 1] - ids[i] + 1));
      i = j;
    }
  }

  // A block of `slots` consecutive ids for a new range: a released block that fits, else fresh ids.
  PageId take_block(size_t slots) {
    for (auto it = free_blocks_.begin(); it != free_blocks_.end(); ++it) {
      if (it->second < slots) continue;
      const PageId base = it->first;
      if (it->second == slots) {
        free_blocks_.erase(it);
      } else {
        it->first += static_cast<PageId>(slots);
        it->second -= slots;
      }
      return base;
    }
    const PageId base = next_id_;
    next_id_ += static_cast<PageId>(slots);
    return base;
  }

  // The ids of a reservation that failed: at the end they go back to the end (a failed huge reservation must
  // not leave the pool sizing its tables to it). Released ranges' ids go to free_blocks_ instead: one of
  // their pages may still be mapped elsewhere, and its id must stay valid.
  void give_back_block(PageId base, size_t slots) {
    if (base + static_cast<PageId>(slots) == next_id_) {
      next_id_ = base;
    } else {
      free_blocks_.emplace_back(base, slots);
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

  void io(bool read, char* host, off_t off) {
    size_t done = 0;
    while (done < page_size_) {
      ssize_t got = read ? pread(fd_, host + done, page_size_ - done, off + static_cast<off_t>(done))
                         : pwrite(fd_, host + done, page_size_ - done, off + static_cast<off_t>(done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) throw BackendFailure(errno_text(read ? "pread(page)" : "pwrite(page)", got < 0 ? errno : EIO));
      done += static_cast<size_t>(got);
    }
  }

  void copy_through_buffer(PageId dst, PageId src) {
    std::vector<char> buf(page_size_);
    io(true, buf.data(), offset(src));
    io(false, buf.data(), offset(dst));
  }

  size_t page_size_;
  size_t capacity_pages_;
  int fd_ = -1;
  mutable std::mutex mu_;  // regions, id blocks, file size
  PageId next_id_;
  size_t file_pages_ = 0;
  std::map<uintptr_t, Region> regions_;
  std::vector<std::pair<PageId, size_t>> free_blocks_;
};

}  // namespace

std::shared_ptr<Backend> make_host_backend(size_t page_size, size_t capacity_pages) {
  return std::make_shared<HostBackend>(page_size, capacity_pages);
}

}  // namespace vpaged
