// The backend interface: the operations a device must offer for vpaged to put physical pages behind
// virtual address ranges. It is shaped after the CUDA driver's VMM calls (reserve, create, map, unmap,
// copy), so the host implementation (mmap + memfd) and the CUDA one (cuMem*) are interchangeable.
//
// Physical pages are named by dense ids 0..capacity_pages()-1. A backend instance serves one device and
// one page size. Every page with memory is also mapped once in the backend's private "pool window", so
// page-to-page and page-to-host copies never need a caller's mapping.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace vpaged {

using PageId = int64_t;

// A run of consecutive page indices of one reservation: indices first .. first + count - 1, index 0 being the
// page at the reservation's address.
struct IndexRun {
  size_t first;
  size_t count;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:N".
  virtual std::string device() const = 0;
  // DLPack device type and index of memory handed out by this backend.
  virtual int dlpack_device_type() const = 0;
  virtual int device_index() const = 0;

  // False for a backend that maps no memory (the accounting backend): no view or raw pointer may be
  // handed out over its ranges.
  virtual bool addressable() const { return true; }

  virtual size_t page_size() const = 0;
  virtual size_t capacity_pages() const = 0;

  // Physical pages come into existence ahead of need (cuMemCreate is slow): create_pages() adds up to `count`
  // more general ids at the end of those that exist (page_ids()), bounded by capacity, each with memory.
  // created_pages(): the pages that have memory now. It equals the general ids until release_pages gives
  // the memory of some back (CUDA: trim releases the handles of free pages); the host and accounting
  // backends create every id at once and count them all (the host's file is sparse: its RSS is what is
  // resident).
  virtual size_t created_pages() const = 0;
  virtual void create_pages(size_t count) = 0;
  // Give a free page's memory back to the system where the backend can (host: punch a hole; the page
  // then reads as zeros). The page id stays valid.
  virtual void discard_page(PageId page) = 0;
  // discard_page for pages no one references any more; the pool calls it whenever pages go free. Never
  // throws: a page whose memory could not be returned is still free.
  virtual void discard_pages(const PageId* pages, size_t n) noexcept {
    for (size_t i = 0; i < n; ++i) {
      try {
        discard_page(pages[i]);
      } catch (...) {
      }
    }
  }
  // Make pages read as zeros (the pool's zero_on_reuse option). Default: copy a zero page into each.
  virtual void zero_pages(const PageId* pages, size_t n, uintptr_t stream) {
    const std::vector<char> zeros(page_size(), 0);
    for (size_t i = 0; i < n; ++i) copy_from_host(pages[i], zeros.data(), stream);
    synchronize(stream);
  }

  // True when a page freed (discard_pages) and handed out again reads as zeros with no further work.
  virtual bool freed_pages_read_zero() const { return false; }

  // Releasing free pages (PagePool::trim, and a pool whose limit drops below its pages with memory).
  // keeps_freed_memory(): whether a free page keeps its memory until release_pages (CUDA: discard_pages
  // cannot give a handle's memory back, and cuMemCreate costs ~0.2 ms, so freed pages keep it for reuse).
  // The pool then keeps the pages it holds memory for within its limit. False on the host (discard_pages
  // already punched the hole) and the accounting backend (no memory).
  virtual bool keeps_freed_memory() const { return false; }
  // Give the memory of free pages back. Returns r: pages[0..r) (the array reordered) have no memory now and
  // must pass through ensure_backed before anyone uses them; the others keep theirs. The default punches
  // holes (discard_pages) and returns 0: such pages need nothing before reuse. Never throws: a page whose
  // memory could not be released keeps it and stays usable.
  virtual size_t release_pages(PageId* pages, size_t n) noexcept {
    discard_pages(pages, n);
    return 0;
  }
  // Give memory again to the released pages among pages[0..n) (CUDA: cuMemCreate, map into the pool window,
  // set access); pages with memory are left alone. All or nothing: on failure none of the released ones has
  // memory, and OutOfPages (the device is short of memory) or BackendFailure is thrown.
  virtual void ensure_backed(const PageId* pages, size_t n) { (void)pages, (void)n; }

  // Page ids that exist: 0..page_ids()-1. Ids below capacity_pages() are "general" pages, the pool's free
  // list (on CUDA the ids created so far, released ones included: general_page_ids()). The host backend adds a
  // block of "home" ids per reserved range (home_page) and the ids of file pages; CUDA has no home ids, and gives
  // imported pages ids from capacity_pages() on.
  virtual size_t page_ids() const { return created_pages(); }
  // The page that shows at `va` of a reserved range without a mapping call of its own, -1 if none. The
  // pool hands a page index its home page when it is free, so pages that stay where they were first mapped
  // cost no mapping (host: a range is one mapping of its own stretch of the pool's file). The home pages
  // of one reservation are consecutive ids: home_page(va + k * page_size) == home_page(va) + k.
  virtual PageId home_page(uintptr_t va) const {
    (void)va;
    return -1;
  }

  // Virtual address space: reserve returns a page-aligned address of `bytes` (a multiple of page_size)
  // with nothing mapped. Reading unmapped reserved memory faults.
  virtual uintptr_t reserve(size_t bytes) = 0;
  virtual void release(uintptr_t va, size_t bytes) = 0;

  // Map pages[0..n) at va, va + page_size, ... Either all are mapped or none (on failure the backend
  // undoes what it did and throws).
  virtual void map(uintptr_t va, const PageId* pages, size_t n) = 0;
  // Unmap n consecutive pages of a range starting at va; the address range stays reserved.
  virtual void unmap(uintptr_t va, size_t n) = 0;

  // map() and unmap() of several runs of indices of the reservation at `va` in one call: a range mapping or
  // unmapping scattered pages makes one backend call, not one per run. map_runs: run k shows the next
  // runs[k].count entries of `pages`. On failure the runs before the failing one stay mapped (map_runs) or
  // unmapped (unmap_runs), *done says how many they are, the failing run is as map() / unmap() leaves it,
  // and the error is rethrown. The defaults call map() / unmap() per run.
  virtual void map_runs(uintptr_t va, const IndexRun* runs, size_t nruns, const PageId* pages, size_t* done) {
    for (*done = 0; *done < nruns; ++*done) {
      map(va + runs[*done].first * page_size(), pages, runs[*done].count);
      pages += runs[*done].count;
    }
  }
  virtual void unmap_runs(uintptr_t va, const IndexRun* runs, size_t nruns, size_t* done) {
    for (*done = 0; *done < nruns; ++*done) unmap(va + runs[*done].first * page_size(), runs[*done].count);
  }

  // Make page indices of the reservation at `va` show other pages, as one change (reordering beams,
  // copy-on-write): index indices[i] shows pages[i] instead of olds[i] (-1 on either side: unmapped). The
  // indices are distinct. All or nothing: on failure every index shows olds[i] again and the error is
  // rethrown. Where even that failed (a device error while undoing), lost[i] is set (the caller zeroes
  // lost[0..n)): the index is unmapped and the caller keeps the references of olds[i] and pages[i], as either
  // may still be mapped there. The default unmaps and maps index by index and undoes newest first; the host
  // backend first makes sure it can undo at the mapping limit (host_backend.cpp).
  virtual void remap(uintptr_t va, const size_t* indices, const PageId* olds, const PageId* pages, size_t n,
                     bool* lost) {
    const size_t ps = page_size();
    std::vector<PageId> now(olds, olds + n);  // what each index shows
    try {
      for (size_t k = 0; k < n; ++k) {
        if (now[k] == pages[k]) continue;
        const uintptr_t at = va + indices[k] * ps;
        if (now[k] >= 0) {
          unmap(at, 1);
          now[k] = -1;
        }
        if (pages[k] >= 0) {
          map(at, &pages[k], 1);
          now[k] = pages[k];
        }
      }
    } catch (...) {
      for (size_t k = n; k-- > 0;) {
        if (now[k] == olds[k]) continue;
        const uintptr_t at = va + indices[k] * ps;
        try {
          if (now[k] >= 0) {
            unmap(at, 1);
            now[k] = -1;
          }
          if (olds[k] >= 0) {
            map(at, &olds[k], 1);
            now[k] = olds[k];
          }
        } catch (...) {
          lost[k] = true;
        }
      }
      throw;
    }
  }

  // Data movement between pages and host memory. `stream` is a CUDA stream handle (0: the default
  // stream); the host backend ignores it. Copies are ordered on that stream; synchronize() waits.
  virtual void copy_page(PageId dst, PageId src, uintptr_t stream) = 0;
  virtual void copy_to_host(PageId src, void* host, uintptr_t stream) = 0;
  virtual void copy_from_host(PageId dst, const void* host, uintptr_t stream) = 0;
  virtual void synchronize(uintptr_t stream) = 0;
  // copy_to_host / copy_from_host of n pages in one call: page pages[i] to / from host[i] (swapping a sequence
  // out or in). A run of consecutive page ids whose host buffers follow each other is one copy (host: one
  // pread / pwrite; CUDA: one cuMemcpy of the pool window). The defaults copy page by page.
  virtual void copy_pages_to_host(const PageId* pages, char* const* host, size_t n, uintptr_t stream) {
    for (size_t i = 0; i < n; ++i) copy_to_host(pages[i], host[i], stream);
  }
  virtual void copy_pages_from_host(const PageId* pages, const char* const* host, size_t n, uintptr_t stream) {
    for (size_t i = 0; i < n; ++i) copy_from_host(pages[i], host[i], stream);
  }
  // Copy the first `bytes` of page src to `dst`, an address of a reserved range of this backend that a page
  // other than src is mapped at (a beam's own last page taking another beam's tokens: no mapping changes).
  // Only where can_copy_page_to() says so; the caller shares the page instead elsewhere.
  virtual bool can_copy_page_to() const { return false; }
  virtual void copy_page_to(uintptr_t dst, PageId src, size_t bytes, uintptr_t stream) {
    (void)dst, (void)src, (void)bytes, (void)stream;
    throw std::logic_error("copy_page_to: not offered by this backend");
  }
  // FILE PAGES: pages of a file other than the backend's own memory (a page store's data file, vpaged/memory/store/),
  // mapped into ranges with no copy. attach_file_pages gives the page of `fd` at each offsets[i] (a multiple of the OS
  // page, inside the file) an id of its own in out[i]; the backend keeps its own descriptor of the file until the
  // last of its pages is detached. A file page is mapped private (MAP_PRIVATE): nothing written through a range can
  // ever reach the file, and the caller copies before writing (copy-on-write) in any case. It is read-only to the
  // backend's own calls (zero_pages, copy_page / copy_pages_from_host into it: InvalidArgument) and is never
  // discarded. A range showing one is under the fault guard (core/fault_guard.h): if the file is cut short under it,
  // a read there completes on zeros instead of killing the process, and file_page_faults() counts it. Only where
  // can_attach_file_pages(). All or nothing: on error no id was given.
  virtual bool can_attach_file_pages() const { return false; }
  virtual void attach_file_pages(int fd, const uint64_t* offsets, size_t n, PageId* out) {
    (void)fd, (void)offsets, (void)n, (void)out;
    throw std::logic_error("attach_file_pages: not offered by this backend");
  }
  // The id goes back (the page must be mapped nowhere). Never throws.
  virtual void detach_file_page(PageId page) noexcept { (void)page; }
  virtual bool is_file_page(PageId page) const {
    (void)page;
    return false;
  }
  // Reads of file pages that faulted because their file was cut short (answered with zeros), in live ranges and
  // released ones.
  virtual size_t file_page_faults() const { return 0; }

  // SHARED DEVICE PAGES (CUDA): a page's physical memory handed to another process on the machine as a POSIX file
  // descriptor, which that process maps into its own ranges: the same device memory, no copy (docs/kv-store.md,
  // "On CUDA"). export_page returns a new descriptor of the general page `page` (cuMemExportToShareableHandle); the
  // caller owns it and closes it once sent (over a Unix socket, SCM_RIGHTS): the memory lives while any process
  // holds a handle or a mapping of it, so the exporter's death does not end an importer's pages. import_pages gives
  // the allocation behind each descriptor (cuMemImportFromShareableHandle) an id of its own in out[i]; the caller's
  // descriptors stay its own. An imported page is read-only: ranges map it with read access only, and the backend's
  // own writes into it (copy_page, copy_from_host, zero_pages into it) are InvalidArgument; a writer copies it first
  // (copy-on-write), as for a file page. It is not the pool's memory (no capacity, never released by trim);
  // release_imported_page gives its id back once it is mapped nowhere (never throws). Only where can_share_pages():
  // the device supports POSIX file-descriptor handles and the backend made its pages with them. All or nothing: on
  // error no id was given. InvalidArgument for a descriptor that is not a page of this size on this device.
  virtual bool can_share_pages() const { return false; }
  // Why pages are not shared here (for errors); "" where can_share_pages().
  virtual std::string share_unavailable_reason() const { return "only CUDA device pages are shared this way"; }
  virtual int export_page(PageId page) {
    (void)page;
    throw std::logic_error("export_page: not offered by this backend");
  }
  virtual void import_pages(const int* fds, size_t n, PageId* out) {
    (void)fds, (void)n, (void)out;
    throw std::logic_error("import_pages: not offered by this backend");
  }
  virtual void release_imported_page(PageId page) noexcept { (void)page; }
  virtual bool is_imported_page(PageId page) const {
    (void)page;
    return false;
  }
  // The general ids that exist (0..general_page_ids()-1, below capacity_pages()): the pool's free list draws on
  // them. CUDA's ids beyond them (imported pages) sit above capacity, while general ids still grow below it.
  virtual size_t general_page_ids() const { return std::min(page_ids(), capacity_pages()); }

  // Wait for all work queued on the device, on every stream (CUDA: cuCtxSynchronize in the device's
  // primary context). Needed before unmapping memory whose users' streams are unknown. The host has
  // no queued work: its copies and kernels finish before they return. Throws CaptureActive when a CUDA
  // graph capture forbids the wait (the call may also have invalidated that capture: see capturing()).
  virtual void synchronize_device() {}
  // Whether `stream` (0: the legacy default stream) is capturing a CUDA graph now, or (stream 0) a capture
  // makes using the legacy stream an error. Asking never disturbs a capture, unlike synchronize_device().
  // False on backends without streams, and when the driver cannot answer.
  virtual bool capturing(uintptr_t stream) {
    (void)stream;
    return false;
  }
  // Whether this backend's mapping calls would break a CUDA graph capture running in the process (CUDA: in the
  // global capture mode any thread's cuMemUnmap / cuMemMap / ... invalidates it). Where true, the pool defers
  // releases and ranges defer unmapping while the process-wide capture flag is up (page_pool.h).
  virtual bool mapping_breaks_capture() const { return false; }

  // Backend-level call counters, for benchmarks (map/unmap calls issued to the OS or driver).
  size_t map_calls() const { return map_calls_; }
  size_t unmap_calls() const { return unmap_calls_; }
  // Unmaps of a run of separately mapped pages that the driver refused as one call, each then done page by
  // page (CUDA: cuMemUnmap wants the range of one mapping; cuda_backend.cpp "Unmapping a run"). 0 elsewhere.
  size_t unmap_fallbacks() const { return unmap_fallbacks_; }

 protected:
  // Atomic: ranges on different threads may map through one backend at once.
  std::atomic<size_t> map_calls_{0};
  std::atomic<size_t> unmap_calls_{0};
  std::atomic<size_t> unmap_fallbacks_{0};
};

// Host backend: a sparse memfd is the physical memory; capacity_pages is the budget the pool enforces.
std::shared_ptr<Backend> make_host_backend(size_t page_size, size_t capacity_pages);

// Accounting backend (csrc/backends/accounting_backend.cpp): pages and reservations are counted, no memory is
// mapped; views over its ranges are refused. For simulating KV memory at GPU scale on any host.
std::shared_ptr<Backend> make_accounting_backend(size_t page_size, size_t capacity_pages);

// CUDA backend (csrc/backends/cuda_backend.cpp). Throws BackendUnavailable with the reason when CUDA cannot
// be used (built without CUDA, no driver, no such device).
std::shared_ptr<Backend> make_cuda_backend(int device, size_t page_size, size_t capacity_pages, size_t reserve_pages);
// Why CUDA is unusable ("" when it is usable), and the VMM granularity of a device (0 if unusable).
std::string cuda_unavailable_reason(int device);
size_t cuda_granularity(int device);
int cuda_device_count();
bool built_with_cuda();
// Whether the process holds its own reference on the device's primary context (from its first CUDA backend
// on, to the end: closing the last cache then never destroys the context).
bool cuda_primary_context_held(int device);

}  // namespace vpaged
