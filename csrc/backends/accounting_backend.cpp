// Accounting backend: tracks pages and address space like a real device but maps no memory, so the real
// caches (VirtualKVCache, its pool and ranges) run at the scale of an 80 GB GPU on a small host. It is
// what `vpaged simulate` measures memory with: every page count, map call and reference is the one the
// host or CUDA backend would see, and nothing can be read or written.
//
// Addresses: reserve() hands out numbers from a private counter, spaced like real reservations, that
// point at nothing. That is safe only because such a range refuses views (Backend::addressable() is
// false: VirtualRange::make_dlpack throws) and its pool refuses copies to and from host memory; copies
// between pages are pure bookkeeping.
#include <mutex>

#include "core/backend.h"
#include "core/errors.h"

namespace vpaged {
namespace {

class AccountingBackend final : public Backend {
 public:
  AccountingBackend(size_t page_size, size_t capacity_pages) : page_size_(page_size), capacity_pages_(capacity_pages) {
    if (page_size == 0 || page_size % 4096 != 0) {
      throw InvalidArgument("page_size must be a positive multiple of 4096 bytes, got " + std::to_string(page_size));
    }
    if (capacity_pages == 0) throw InvalidArgument("a page pool needs a capacity of at least one page");
  }

  std::string device() const override { return "cpu"; }
  int dlpack_device_type() const override { return 1; /* kDLCPU: never used, views are refused */ }
  int device_index() const override { return 0; }
  bool addressable() const override { return false; }
  size_t page_size() const override { return page_size_; }
  size_t capacity_pages() const override { return capacity_pages_; }
  size_t created_pages() const override { return capacity_pages_; }
  void create_pages(size_t) override {}
  void discard_page(PageId page) override { check_page(page); }

  uintptr_t reserve(size_t bytes) override {
    if (bytes == 0 || bytes % page_size_ != 0) {
      throw InvalidArgument("reserve: size must be a positive multiple of the page size");
    }
    std::lock_guard<std::mutex> lock(mu_);
    // Page-aligned, never 0, never overlapping an earlier reservation; a guard page apart.
    const uintptr_t va = next_va_;
    next_va_ += bytes + page_size_;
    return va;
  }
  void release(uintptr_t, size_t) override {}

  void map(uintptr_t, const PageId* pages, size_t n) override {
    for (size_t i = 0; i < n; ++i) check_page(pages[i]);
    ++map_calls_;
  }
  void unmap(uintptr_t, size_t) override { ++unmap_calls_; }

  void copy_page(PageId dst, PageId src, uintptr_t) override {
    check_page(dst);
    check_page(src);
  }
  // Pages hold nothing here: a beam's last page taking another's tokens is bookkeeping only.
  bool can_copy_page_to() const override { return true; }
  void copy_page_to(uintptr_t, PageId src, size_t, uintptr_t) override { check_page(src); }
  void copy_to_host(PageId, void*, uintptr_t) override { refuse("copy_to_host"); }
  void copy_from_host(PageId, const void*, uintptr_t) override { refuse("copy_from_host"); }
  void synchronize(uintptr_t) override {}

 private:
  [[noreturn]] static void refuse(const char* what) {
    throw InvalidArgument(std::string(what) + ": the accounting backend holds no data (it counts pages only)");
  }
  void check_page(PageId page) const {
    if (page < 0 || static_cast<size_t>(page) >= capacity_pages_) {
      throw InvalidArgument("page id " + std::to_string(page) + " out of range");
    }
  }

  size_t page_size_;
  size_t capacity_pages_;
  std::mutex mu_;
  uintptr_t next_va_ = uintptr_t{1} << 46;
};

}  // namespace

std::shared_ptr<Backend> make_accounting_backend(size_t page_size, size_t capacity_pages) {
  return std::make_shared<AccountingBackend>(page_size, capacity_pages);
}

}  // namespace vpaged
