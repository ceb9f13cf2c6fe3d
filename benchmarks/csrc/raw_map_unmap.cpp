// Part of vpaged_bench_ext (bench_ext.cpp), not of vpaged._C.
// Reference loops for benchmarks/bench_mapping.py: the bare system calls a host design issues to map and
// unmap one page, with no bookkeeping and no Python in the loop: the floor vpaged is compared with.
//
//   per_page: every page its own mapping: mmap(MAP_SHARED | MAP_FIXED) of a memfd page, then
//             mmap(PROT_NONE) over it (the backend before the home-page design; 2 mappings per page).
//   anon:     one anonymous private mapping; a page's memory is returned with madvise(MADV_DONTNEED).
//   home:     one shared mapping of a memfd stretch; mapping a page is nothing, unmapping punches its
//             hole with fallocate (the current backend).
// touch: write one byte into each 4 KiB of the page after mapping it (the first-use faults).
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>

namespace vpaged {

namespace {
void touch_page(char* p, size_t page_size) {
  for (size_t o = 0; o < page_size; o += 4096) p[o] = 1;
}
}  // namespace

double raw_map_unmap_seconds_per_page(size_t page_size, size_t pages, const std::string& design, bool touch) {
  if (design != "per_page" && design != "anon" && design != "home") throw std::invalid_argument("design");
  int fd = memfd_create("vpaged-bench", MFD_CLOEXEC);
  const size_t span = 2 * pages * page_size;
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(span)) != 0) throw std::runtime_error("memfd");
  char* base = nullptr;
  if (design == "per_page") {
    base = static_cast<char*>(mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  } else if (design == "anon") {
    base = static_cast<char*>(
        mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  } else {
    base = static_cast<char*>(mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0));
  }
  if (base == MAP_FAILED) throw std::runtime_error("mmap reserve");
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < pages; ++i) {
    char* addr = base + 2 * i * page_size;  // every other page: scattered pages
    if (design == "per_page") {
      mmap(addr, page_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, static_cast<off_t>(i * page_size));
      if (touch) touch_page(addr, page_size);
      mmap(addr, page_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    } else if (design == "anon") {
      if (touch) touch_page(addr, page_size);
      madvise(addr, page_size, MADV_DONTNEED);
    } else {
      if (touch) touch_page(addr, page_size);
      fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(2 * i * page_size),
                static_cast<off_t>(page_size));
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  munmap(base, span);
  close(fd);
  return std::chrono::duration<double>(t1 - t0).count() / static_cast<double>(pages);
}

}  // namespace vpaged
