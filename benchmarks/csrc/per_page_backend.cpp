// Part of vpaged_bench_ext (bench_ext.cpp), not of vpaged._C.
// Reference design for benchmarks/bench_mapping.py only: the host backend before home pages. Every page is
// its own mmap(MAP_SHARED | MAP_FIXED) of a memfd offset over a PROT_NONE reservation, and unmapping puts
// PROT_NONE back, so scattered pages cost a mapping each (vm.max_map_count bound the cache). Kept to
// compare the two designs through the same pool and range code in one run.
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "core/backend.h"
#include "core/errors.h"

namespace vpaged {
namespace {

std::string errno_text(const char* call, int err) { return std::string(call) + " failed: " + std::strerror(err); }

long read_max_map_count() {
  std::ifstream f("/proc/sys/vm/max_map_count");
  long v = -1;
  if (f) f >> v;
  return v;
}

// mmap failing with ENOMEM on a MAP_FIXED request means the process hit vm.max_map_count (or, rarely,
// its address-space limit): a resource limit the caller can act on, not a crash.
[[noreturn]] void throw_mmap_error(const char* call, int err) {
  if (err == ENOMEM) {
    throw MappingLimit(std::string(call) + " failed: the process ran out of memory mappings (vm.max_map_count = " +
                       std::to_string(read_max_map_count()) +
                       "); use larger pages or fewer sequences, or raise vm.max_map_count");
  }
  throw BackendFailure(errno_text(call, err));
}

class PerPageHostBackend final : public Backend {
 public:
  PerPageHostBackend(size_t page_size, size_t capacity_pages) : page_size_(page_size), capacity_pages_(capacity_pages) {
    const long os_page = sysconf(_SC_PAGESIZE);
    if (page_size == 0 || page_size % static_cast<size_t>(os_page) != 0) {
      throw InvalidArgument("page_size must be a positive multiple of the OS page size (" + std::to_string(os_page) +
                            " bytes), got " + std::to_string(page_size));
    }
    if (capacity_pages == 0) throw InvalidArgument("a page pool needs a capacity of at least one page");
    fd_ = memfd_create("vpaged-pool", MFD_CLOEXEC);
    if (fd_ < 0) throw BackendFailure(errno_text("memfd_create", errno));
    const size_t bytes = page_size * capacity_pages;
    if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      int err = errno;
      close(fd_);
      throw BackendFailure(errno_text("ftruncate(pool)", err));
    }
    void* w = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd_, 0);
    if (w == MAP_FAILED) {
      int err = errno;
      close(fd_);
      throw BackendFailure(errno_text("mmap(pool window)", err));
    }
    window_ = static_cast<char*>(w);
  }

  ~PerPageHostBackend() override {
    munmap(window_, page_size_ * capacity_pages_);
    close(fd_);
  }

  std::string device() const override { return "cpu"; }
  int dlpack_device_type() const override { return 1; /* kDLCPU */ }
  int device_index() const override { return 0; }
  size_t page_size() const override { return page_size_; }
  size_t capacity_pages() const override { return capacity_pages_; }
  // The memfd is sized to capacity up front and is sparse: every page exists at no cost.
  size_t created_pages() const override { return capacity_pages_; }
  void create_pages(size_t) override {}

  void discard_page(PageId page) override {
    check_page(page);
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset(page), static_cast<off_t>(page_size_)) != 0) {
      throw BackendFailure(errno_text("fallocate(PUNCH_HOLE)", errno));
    }
  }

  // As before home pages: a freed page keeps its memory until PagePool::trim.
  void discard_pages(const PageId*, size_t) noexcept override {}

  uintptr_t reserve(size_t bytes) override {
    if (bytes == 0 || bytes % page_size_ != 0) {
      throw InvalidArgument("reserve: size must be a positive multiple of the page size");
    }
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw_mmap_error("mmap(reserve)", errno);
    return reinterpret_cast<uintptr_t>(p);
  }

  void release(uintptr_t va, size_t bytes) override {
    if (munmap(reinterpret_cast<void*>(va), bytes) != 0) {
      throw BackendFailure(errno_text("munmap(release)", errno));
    }
  }

  void map(uintptr_t va, const PageId* pages, size_t n) override {
    for (size_t i = 0; i < n; ++i) check_page(pages[i]);
    size_t done = 0;
    while (done < n) {
      // Pages with consecutive ids are consecutive in the file: one mmap maps the whole run.
      size_t run = 1;
      while (done + run < n && pages[done + run] == pages[done] + static_cast<PageId>(run)) ++run;
      void* want = reinterpret_cast<void*>(va + done * page_size_);
      void* got =
          mmap(want, run * page_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_, offset(pages[done]));
      ++map_calls_;
      if (got == MAP_FAILED) {
        int err = errno;
        if (done > 0) unmap_quietly(va, done);
        throw_mmap_error("mmap(map page)", err);
      }
      done += run;
    }
  }

  void unmap(uintptr_t va, size_t n) override {
    void* addr = reinterpret_cast<void*>(va);
    const size_t len = n * page_size_;
    ++unmap_calls_;
    void* p = mmap(addr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p != MAP_FAILED) return;
    int err = errno;
    // At vm.max_map_count every mmap is refused, even one that would lower the count. munmap is not
    // (unless it must split a mapping), and then re-reserving the hole fits under the limit again.
    if (err != ENOMEM || munmap(addr, len) != 0) throw_mmap_error("mmap(unmap page)", err);
    p = mmap(addr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED || p != addr) {
      // The hole is unmapped either way (reads fault); only the reservation of these pages is lost.
      throw BackendFailure(errno_text("mmap(re-reserve after unmap)", errno));
    }
  }

  void copy_page(PageId dst, PageId src, uintptr_t) override {
    check_page(dst);
    check_page(src);
    std::memcpy(window_ + offset(dst), window_ + offset(src), page_size_);
  }
  void copy_to_host(PageId src, void* host, uintptr_t) override {
    check_page(src);
    std::memcpy(host, window_ + offset(src), page_size_);
  }
  void copy_from_host(PageId dst, const void* host, uintptr_t) override {
    check_page(dst);
    std::memcpy(window_ + offset(dst), host, page_size_);
  }
  void synchronize(uintptr_t) override {}

 private:
  off_t offset(PageId page) const { return static_cast<off_t>(page) * static_cast<off_t>(page_size_); }
  void check_page(PageId page) const {
    if (page < 0 || static_cast<size_t>(page) >= capacity_pages_) {
      throw InvalidArgument("page id " + std::to_string(page) + " out of range");
    }
  }
  void unmap_quietly(uintptr_t va, size_t n) noexcept {
    mmap(reinterpret_cast<void*>(va), n * page_size_, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  }

  size_t page_size_;
  size_t capacity_pages_;
  int fd_ = -1;
  char* window_ = nullptr;
};

}  // namespace

std::shared_ptr<Backend> make_per_page_host_backend(size_t page_size, size_t capacity_pages) {
  return std::make_shared<PerPageHostBackend>(page_size, capacity_pages);
}

}  // namespace vpaged
