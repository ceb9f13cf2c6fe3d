// Reference loop for benchmarks/bench_mapping.py: the bare syscalls vpaged's host backend issues to map
// and unmap one page, with no bookkeeping and no Python in the loop — the floor vpaged is compared with.
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>

namespace vpaged {

double raw_map_unmap_seconds_per_page(size_t page_size, size_t pages) {
  int fd = memfd_create("vpaged-bench", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(page_size * pages)) != 0) throw std::runtime_error("memfd");
  const size_t span = 2 * pages * page_size;
  char* base = static_cast<char*>(
      mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (base == MAP_FAILED) throw std::runtime_error("mmap reserve");
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < pages; ++i) {
    char* addr = base + 2 * i * page_size;  // every other slot: separate mappings
    mmap(addr, page_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, static_cast<off_t>(i * page_size));
    mmap(addr, page_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  }
  auto t1 = std::chrono::steady_clock::now();
  munmap(base, span);
  close(fd);
  return std::chrono::duration<double>(t1 - t0).count() / static_cast<double>(pages);
}

}  // namespace vpaged
