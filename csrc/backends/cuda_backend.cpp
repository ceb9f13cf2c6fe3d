// CUDA backend: physical pages are cuMemCreate handles, virtual ranges are cuMemAddressReserve spans,
// mapping is cuMemMap + cuMemSetAccess. Compiled by the host compiler; cuda.h supplies types only.
//
// The driver is never linked. libcuda.so.1 is dlopen'd once per process (std::call_once), the versioned
// cuGetProcAddress_v2 is the one symbol taken with dlsym, and every other entry point comes from it at a
// fixed driver-API version (kDriverApi), so `import vpaged` works on machines without a driver and says
// why CUDA is unavailable when it is.
//
// Contexts: each backend retains its device's primary context (the one torch and the runtime use) and
// makes it current around every driver call with push/pop rather than cuCtxSetCurrent, because the
// caller may be any thread and may have another device current for torch: we must not change what a
// thread's current device is behind its back.
//
// STREAM-SAFETY PROTOCOL (the backend does not track streams; the cache layers above must):
//   * map() is synchronous with respect to the host: once it returns, work enqueued later on any stream
//     may use the new mapping.
//   * unmap() (and remapping a page index: copy_on_write, replace) does NOT wait for kernels or copies still
//     queued on streams that read or write the page through that address; cuMemUnmap is not a reliable
//     barrier. Callers must unmap or remap a page index only after the work on every stream that may touch it
//     has completed (stream/event synchronisation, or deferred reclamation at a step boundary that is
//     known to be complete). The same holds for dropping the last reference to a page and handing it to
//     another sequence: the new owner's writes are ordered only on its own stream.
//   * copy_page / copy_to_host / copy_from_host are asynchronous on the given stream (0: the legacy
//     default stream). Host buffers must stay alive, and unread, until synchronize(stream) returns (or
//     later work on that stream is known to be complete). With pageable host memory the driver may make
//     the copy synchronous; pinned memory is needed for overlap.
//   * Releasing the backend (last PagePool / range / view gone) unmaps the pool window and frees every
//     page without synchronising: no stream may still be using any page at that point.
//   * release_pages (PagePool::trim, a lowered pool limit) unmaps free pages from the pool window and
//     releases their handles, also without synchronising: the pages are free, so by the rule above no work
//     still touches them. (Waiting here would not be allowed anyway: the budget's give-back thread trims
//     while the engine may be capturing a CUDA graph, and a device-wide wait would invalidate the capture.)
//
// GIVING MEMORY BACK. Page ids are a growing prefix (created_) of the pool window; each id with memory has
// a handle (handles_[id] != 0) mapped at its window address. A free page keeps its handle (cuMemCreate is the
// slow call), so device memory is only returned by release_pages, which the pool calls from trim() and when
// a shared budget lowers its limit: the window mapping goes (one cuMemUnmap per run of consecutive ids), the
// handle is released, and the id stays valid without memory ("released": handles_[id] == 0). Before the pool
// hands a released id out again it calls ensure_backed, which creates a new handle, maps it at the same
// window address and sets access; every id that check_page accepts has memory, so no copy, map or view can
// reach a released page. Costs (A100, DESIGN.md): ~26 us of cuMemUnmap per run plus a cuMemRelease per page to
// release; ~0.2 ms of cuMemCreate per page plus ~36 us of cuMemSetAccess per run to re-create.
//
// UNMAPPING A RUN. Every page is its own mapping (one cuMemMap per handle). The driver API reference says the
// range given to cuMemUnmap "must be the entire contiguous address range that was mapped to": one mapping.
// Drivers have accepted a run of whole mappings in one call (cheaper: ~26 us per call), so a run is tried as
// one call first; where the driver refuses it, every page of the run is unmapped with a call of its own
// (unmap_run), and the refusal is counted (Backend::unmap_fallbacks, PoolStats.unmap_fallbacks).
//
// SHARED PAGES (core/backend.h, "SHARED DEVICE PAGES"). Where the device supports POSIX file-descriptor handles
// (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) every page is made with that handle type
// requested (VPAGED_CUDA_SHAREABLE_PAGES=0 turns it off), so any page can be exported later: the type cannot be
// added to an allocation afterwards. Imported pages get ids from capacity_pages_ on (slot k: id capacity_pages_ +
// k), each mapped once into an import window of its own (reserved at the first import, kMinImportSlots or
// capacity_pages_ slots, whichever is more: imports are not the pool's capacity, and virtual address space is cheap
// on a GPU) with read-only access, so copies read it there; ranges map it read-only too. Its handle is released with
// its last reference (release_imported_page).
#include <memory>
#include <string>

#include "core/backend.h"
#include "core/errors.h"

#ifndef VPAGED_WITH_CUDA

namespace vpaged {
bool built_with_cuda() { return false; }
std::string cuda_unavailable_reason(int) { return "vpaged was built without CUDA"; }
size_t cuda_granularity(int) { return 0; }
int cuda_device_count() { return 0; }
bool cuda_primary_context_held(int) { return false; }
std::shared_ptr<Backend> make_cuda_backend(int device, size_t, size_t, size_t) {
  throw BackendUnavailable(cuda_unavailable_reason(device));
}
}  // namespace vpaged

#else  // VPAGED_WITH_CUDA

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#if CUDA_VERSION < 12000
#error "the vpaged CUDA backend needs CUDA 12.0+ headers (cuGetProcAddress with a symbol-status argument)"
#endif

namespace vpaged {
namespace {

// Entry points are requested at this driver-API version. Every function below has had its current
// signature (the _v2 variants cuda.h maps the plain names to) since CUDA 12.0 or earlier, and asking for
// a version above the installed driver's fails, so 12.0 keeps any 12.x or newer driver usable.
constexpr int kDriverApi = 12000;

// The driver functions used. cuda.h #defines some plain names to versioned ones (cuCtxPushCurrent ->
// cuCtxPushCurrent_v2, cuMemcpyDtoHAsync -> cuMemcpyDtoHAsync_v2, ...): `#name` below stringizes the
// plain name (what cuGetProcAddress wants), while `decltype(&::name)` and the member name expand to the
// versioned declaration, consistently with every use of the member in this file.
// The formatter re-indents this list differently on each pass: it is kept as written.
// clang-format off
#define VPAGED_CU_FUNCTIONS(X)                                                                     \
  X(cuGetErrorName) X(cuGetErrorString) X(cuInit)                                                  \
  X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetAttribute)                                       \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease)                                         \
  X(cuCtxGetCurrent) X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuCtxSynchronize)                    \
  X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease)                                  \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)           \
  X(cuMemcpyDtoDAsync) X(cuMemcpyDtoHAsync) X(cuMemcpyHtoDAsync) X(cuStreamSynchronize)             \
  X(cuStreamIsCapturing) X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)         \
  X(cuMemGetAllocationPropertiesFromHandle)
// clang-format on

// The process-wide driver table: written once under std::call_once, read-only afterwards.
struct Driver {
#define VPAGED_CU_MEMBER(name) decltype(&::name) name = nullptr;
  VPAGED_CU_FUNCTIONS(VPAGED_CU_MEMBER)
#undef VPAGED_CU_MEMBER
  std::string unavailable;  // why the driver cannot be used; "" when it can
};

std::string result_text(const Driver& d, CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.cuGetErrorName) d.cuGetErrorName(r, &name);
  if (d.cuGetErrorString) d.cuGetErrorString(r, &text);
  std::string out = name ? name : "CUresult " + std::to_string(static_cast<int>(r));
  if (text) out += std::string(" (") + text + ")";
  return out;
}

void load_driver(Driver& d) {
  // Never dlclose'd: the driver stays loaded for the life of the process, as the runtime does it.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    d.unavailable = std::string("libcuda.so.1 not found: no NVIDIA driver on this machine (dlopen: ") +
                    (err ? err : "unknown error") + ")";
    return;
  }
  // cuGetProcAddress_v2 is the CUDA 12+ signature (with the symbol-status out-parameter); drivers
  // older than 12.0 lack it.
  auto get_proc = reinterpret_cast<decltype(&::cuGetProcAddress)>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    d.unavailable =
        "the NVIDIA driver is too old: libcuda.so.1 has no cuGetProcAddress_v2 "
        "(a CUDA 12.0 or newer driver is needed)";
    return;
  }
  auto resolve = [&](const char* symbol, void** target) {
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    // LEGACY_STREAM: stream 0 means the legacy default stream, as it does for torch.
    CUresult r = get_proc(symbol, target, kDriverApi, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status);
    if (r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && *target != nullptr) return true;
    // A driver older than the API version asked for refuses every symbol: say so in its own terms.
    int version = 0;
    auto get_version = reinterpret_cast<CUresult (*)(int*)>(dlsym(lib, "cuDriverGetVersion"));
    if (get_version != nullptr && get_version(&version) == CUDA_SUCCESS && version < kDriverApi) {
      d.unavailable = "the NVIDIA driver is too old: it supports CUDA " + std::to_string(version / 1000) + "." +
                      std::to_string(version % 1000 / 10) + ", vpaged needs " + std::to_string(kDriverApi / 1000) +
                      "." + std::to_string(kDriverApi % 1000 / 10) + " or newer";
      return false;
    }
    d.unavailable = std::string("the NVIDIA driver does not provide ") + symbol + " for CUDA " +
                    std::to_string(kDriverApi / 1000) + "." + std::to_string(kDriverApi % 1000 / 10) +
                    " (cuGetProcAddress returned " + result_text(d, r) + ", symbol status " +
                    std::to_string(static_cast<int>(status)) + ")";
    return false;
  };
#define VPAGED_CU_RESOLVE(name)                       \
  {                                                   \
    void* fn = nullptr;                               \
    if (!resolve(#name, &fn)) return;                 \
    d.name = reinterpret_cast<decltype(&::name)>(fn); \
  }
  VPAGED_CU_FUNCTIONS(VPAGED_CU_RESOLVE)
#undef VPAGED_CU_RESOLVE
  CUresult r = d.cuInit(0);
  if (r != CUDA_SUCCESS) d.unavailable = "cuInit failed: " + result_text(d, r);
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] { load_driver(d); });
  return d;
}

std::string call_error(const char* call, CUresult r) {
  return std::string(call) + " failed: " + result_text(driver(), r);
}

void check(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) throw BackendFailure(call_error(call, r));
}

// Why device `device` cannot hold vpaged pages ("" when it can). Needs no context.
std::string device_problem(int device) {
  const Driver& d = driver();
  if (!d.unavailable.empty()) return d.unavailable;
  int count = 0;
  CUresult r = d.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) return call_error("cuDeviceGetCount", r);
  if (device < 0 || device >= count) {
    return "CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(count) +
           " device(s) visible; see CUDA_VISIBLE_DEVICES)";
  }
  CUdevice dev = 0;
  r = d.cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return call_error("cuDeviceGet", r);
  int vmm = 0;
  r = d.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (r != CUDA_SUCCESS) return call_error("cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)", r);
  if (!vmm) {
    return "CUDA device " + std::to_string(device) +
           " does not support virtual memory management (cuMemCreate / cuMemMap)";
  }
  return "";
}

// Pinned device memory on one device, no compression: what every page is (the backend adds the POSIX
// file-descriptor handle type where the device supports it: "Shared pages" above).
CUmemAllocationProp page_properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// Makes `ctx` current on the calling thread for the guard's lifetime. Push/pop (not cuCtxSetCurrent)
// leaves the thread's own current context as it was; nothing is pushed when ctx is current already.
class ScopedContext {
 public:
  explicit ScopedContext(CUcontext ctx) {
    const Driver& d = driver();
    CUcontext current = nullptr;
    check(d.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
    if (current != ctx) {
      check(d.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
      pushed_ = true;
    }
  }
  ~ScopedContext() {
    if (pushed_) {
      CUcontext popped = nullptr;
      driver().cuCtxPopCurrent(&popped);
    }
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  bool pushed_ = false;
};

// Holds a reference on a device's primary context (created by the first retain, shared with torch).
class PrimaryContext {
 public:
  explicit PrimaryContext(CUdevice dev) : dev_(dev) {
    check(driver().cuDevicePrimaryCtxRetain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
  }
  ~PrimaryContext() { driver().cuDevicePrimaryCtxRelease(dev_); }
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  CUcontext get() const { return ctx_; }

 private:
  CUdevice dev_;
  CUcontext ctx_ = nullptr;
};

// The process keeps one reference on a device's primary context from its first backend on, never
// released: otherwise, until torch initializes CUDA (torch holds its own reference from then on), closing the
// last cache would destroy the primary context and the next cache would create it again, 0.1-0.5 s each.
// The driver destroys it with the process. Taken only once a backend is fully built, so that a refused
// construction leaves no reference behind.
std::mutex process_contexts_mu;
std::vector<CUdevice> process_contexts;  // devices whose primary context the process holds

void retain_for_process(CUdevice dev) {
  std::lock_guard<std::mutex> lock(process_contexts_mu);
  if (std::find(process_contexts.begin(), process_contexts.end(), dev) != process_contexts.end()) return;
  CUcontext ctx = nullptr;
  if (driver().cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS) process_contexts.push_back(dev);
}

bool is_power_of_two(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

// Imported pages a backend can hold at least (8 GiB of virtual address space at 2 MiB pages).
constexpr size_t kMinImportSlots = 4096;

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, size_t page_size, size_t capacity_pages, size_t reserve_pages)
      : device_(device), page_size_(page_size), capacity_pages_(capacity_pages) {
    const std::string why = device_problem(device);
    if (!why.empty()) throw BackendUnavailable(why);
    if (capacity_pages == 0) throw InvalidArgument("a page pool needs a capacity of at least one page");
    const Driver& d = driver();
    check(d.cuDeviceGet(&dev_, device), "cuDeviceGet");
    prop_ = page_properties(device);
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    read_access_.location = prop_.location;
    read_access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    shareable_ = posix_fd_handles(dev_);
    if (shareable_) prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    context_ = std::make_unique<PrimaryContext>(dev_);  // released by the member's destructor
    try {
      ScopedContext current(context_->get());
      size_t granularity = 0;
      check(d.cuMemGetAllocationGranularity(&granularity, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity");
      if (page_size == 0 || granularity == 0 || page_size % granularity != 0) {
        throw InvalidArgument("page_size must be a positive multiple of the CUDA allocation granularity of " +
                              this->device() + " (" + std::to_string(granularity) + " bytes), got " +
                              std::to_string(page_size));
      }
      if (capacity_pages > std::numeric_limits<size_t>::max() / page_size) {
        throw InvalidArgument("capacity_pages * page_size overflows");
      }
      // cuMemAddressReserve wants a power-of-two alignment; cuMemMap only needs granularity alignment.
      alignment_ = is_power_of_two(page_size) ? page_size : (is_power_of_two(granularity) ? granularity : 0);
      // Never resized again: readers index it without the lock (atomic: an id's handle changes when it is
      // released and re-created, while other threads read other ids' handles).
      handles_.reset(new std::atomic<CUmemGenericAllocationHandle>[capacity_pages]);
      for (size_t i = 0; i < capacity_pages; ++i) handles_[i].store(0, std::memory_order_relaxed);
      import_capacity_ = std::max(capacity_pages, kMinImportSlots);
      if (import_capacity_ > std::numeric_limits<size_t>::max() / page_size) {
        throw InvalidArgument("the import window's size overflows");
      }
      imported_.reset(new std::atomic<CUmemGenericAllocationHandle>[import_capacity_]);
      for (size_t i = 0; i < import_capacity_; ++i) imported_[i].store(0, std::memory_order_relaxed);
      check(d.cuMemAddressReserve(&window_, capacity_pages * page_size, alignment_, 0, 0),
            "cuMemAddressReserve(pool window)");
      create_pages(std::min(reserve_pages, capacity_pages));
    } catch (...) {
      free_all();
      throw;
    }
    retain_for_process(dev_);
  }

  ~CudaBackend() override { free_all(); }

  std::string device() const override { return "cuda:" + std::to_string(device_); }
  int dlpack_device_type() const override { return 2; /* kDLCUDA */ }
  int device_index() const override { return device_; }
  size_t page_size() const override { return page_size_; }
  size_t capacity_pages() const override { return capacity_pages_; }
  // Pages with device memory now (live handles); page_ids(): the ids created so far, released ones included.
  size_t created_pages() const override { return backed_.load(std::memory_order_acquire); }
  size_t page_ids() const override {
    const size_t slots = import_slots_.load(std::memory_order_acquire);
    return slots > 0 ? capacity_pages_ + slots : created_.load(std::memory_order_acquire);
  }
  size_t general_page_ids() const override { return created_.load(std::memory_order_acquire); }
  bool keeps_freed_memory() const override { return true; }
  bool mapping_breaks_capture() const override { return true; }

  // Creates up to `count` handles (cuMemCreate is the slow call, ~0.2 ms each) and maps them into the
  // pool window, with one cuMemSetAccess for the whole new run. If device memory runs out part way,
  // the pages that fit are kept and the call returns; only a call that created nothing raises
  // OutOfPages. Window mappings are internal and not counted in map_calls().
  void create_pages(size_t count) override {
    std::lock_guard<std::mutex> lock(create_mu_);
    const size_t first = created_.load(std::memory_order_relaxed);
    count = std::min(count, capacity_pages_ - first);
    if (count == 0) return;
    const Driver& d = driver();
    ScopedContext current(context_->get());
    size_t made = 0;
    CUresult err = CUDA_SUCCESS;
    const char* failed = nullptr;
    for (; made < count; ++made) {
      const size_t id = first + made;
      CUmemGenericAllocationHandle h = 0;
      err = d.cuMemCreate(&h, page_size_, &prop_, 0);
      if (err != CUDA_SUCCESS) {
        failed = "cuMemCreate";
        break;
      }
      err = d.cuMemMap(window_ + id * page_size_, page_size_, 0, h, 0);
      if (err != CUDA_SUCCESS) {
        d.cuMemRelease(h);
        failed = "cuMemMap(pool window)";
        break;
      }
      handles_[id].store(h, std::memory_order_relaxed);
    }
    if (made > 0) {
      const CUdeviceptr run = window_ + first * page_size_;
      CUresult r = d.cuMemSetAccess(run, made * page_size_, &access_, 1);
      if (r != CUDA_SUCCESS) {
        unmap_run(run, made, nullptr, false);
        for (size_t i = first; i < first + made; ++i) d.cuMemRelease(handles_[i].exchange(0));
        throw BackendFailure(call_error("cuMemSetAccess(pool window)", r));
      }
      // Publish only fully usable pages: copies and map() check ids against created_.
      backed_.fetch_add(made, std::memory_order_relaxed);
      created_.store(first + made, std::memory_order_release);
    }
    if (failed == nullptr) return;
    if (err == CUDA_ERROR_OUT_OF_MEMORY) {
      if (made > 0) return;
      throw OutOfPages(device() + " has no memory for another page of " + std::to_string(page_size_) + " bytes (" +
                       std::to_string(first) + " of " + std::to_string(capacity_pages_) +
                       " pages created): " + call_error(failed, err));
    }
    throw BackendFailure(call_error(failed, err));
  }

  // No-op. Device memory has no equivalent of punching a hole: the memory of a handle lives until the
  // handle is released, and releasing every page as it goes free would cost a new cuMemCreate (~0.2 ms)
  // and a new window mapping at each reuse, defeating "create ahead of need". The page's data is left as
  // it was; release_pages gives the memory back when the pool trims.
  void discard_page(PageId page) override { check_page(page); }
  void discard_pages(const PageId*, size_t) noexcept override {}

  // Unmaps the pages from the pool window (one call per run of consecutive ids, or one per page where the
  // driver refuses the run: see "Unmapping a run" above) and releases their handles. A page the driver
  // refuses to unmap keeps its memory and stays usable.
  size_t release_pages(PageId* pages, size_t n) noexcept override {
    try {
      std::lock_guard<std::mutex> lock(create_mu_);
      std::vector<PageId> ids;
      for (size_t i = 0; i < n; ++i)
        if (has_memory(pages[i])) ids.push_back(pages[i]);
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      const Driver& d = driver();
      ScopedContext current(context_->get());
      std::vector<char> unmapped;
      for (size_t i = 0; i < ids.size();) {
        const size_t j = run_end(ids, i);
        unmapped.assign(j - i, 0);
        unmap_run(window_address(ids[i]), j - i, unmapped.data(), false);
        // Out of the window, an id has no memory from here on, whatever cuMemRelease answers (it fails only
        // for a handle that is not live, which there is then nothing left to free for).
        for (size_t k = i; k < j; ++k) {
          if (!unmapped[k - i]) continue;
          d.cuMemRelease(handles_[ids[k]].exchange(0, std::memory_order_acq_rel));
          backed_.fetch_sub(1, std::memory_order_relaxed);
        }
        i = j;
      }
    } catch (...) {  // no current context could be made: nothing was released
    }
    return static_cast<size_t>(
        std::partition(pages, pages + n, [this](PageId p) { return in_window(p) && !has_memory(p); }) - pages);
  }

  // Re-creates released pages: a new handle each, mapped at the id's window address, one cuMemSetAccess per
  // run of consecutive ids. All or nothing: on failure the handles made so far are unmapped and released.
  void ensure_backed(const PageId* pages, size_t n) override {
    std::lock_guard<std::mutex> lock(create_mu_);
    std::vector<PageId> ids;
    for (size_t i = 0; i < n; ++i) {
      if (is_imported_page(pages[i])) continue;        // the exporter's memory: nothing to create
      if (!in_window(pages[i])) check_page(pages[i]);  // throws: not an id of this pool
      if (!has_memory(pages[i])) ids.push_back(pages[i]);
    }
    if (ids.empty()) return;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    const Driver& d = driver();
    ScopedContext current(context_->get());
    std::vector<CUmemGenericAllocationHandle> made(ids.size(), 0);
    size_t mapped = 0;  // made[0..mapped) exist and are mapped into the window
    CUresult err = CUDA_SUCCESS;
    const char* failed = nullptr;
    for (; mapped < ids.size(); ++mapped) {
      err = d.cuMemCreate(&made[mapped], page_size_, &prop_, 0);
      if (err != CUDA_SUCCESS) {
        failed = "cuMemCreate";
        break;
      }
      err = d.cuMemMap(window_address(ids[mapped]), page_size_, 0, made[mapped], 0);
      if (err != CUDA_SUCCESS) {
        d.cuMemRelease(made[mapped]);
        failed = "cuMemMap(pool window)";
        break;
      }
    }
    for (size_t i = 0; failed == nullptr && i < ids.size();) {
      const size_t j = run_end(ids, i);
      err = d.cuMemSetAccess(window_address(ids[i]), (j - i) * page_size_, &access_, 1);
      if (err != CUDA_SUCCESS) failed = "cuMemSetAccess(pool window)";
      i = j;
    }
    if (failed != nullptr) {
      for (size_t k = 0; k < mapped; ++k) {
        d.cuMemUnmap(window_address(ids[k]), page_size_);  // one page: one mapping
        d.cuMemRelease(made[k]);
      }
      if (err == CUDA_ERROR_OUT_OF_MEMORY) {
        throw OutOfPages(device() + " has no memory to re-create " + std::to_string(ids.size()) +
                         " released page(s) of " + std::to_string(page_size_) + " bytes (" +
                         std::to_string(created_pages()) + " pages have memory): " + call_error(failed, err));
      }
      throw BackendFailure(call_error(failed, err));
    }
    // Published only now, with access set: check_page accepts an id only once its memory is usable.
    for (size_t k = 0; k < ids.size(); ++k) handles_[ids[k]].store(made[k], std::memory_order_release);
    backed_.fetch_add(ids.size(), std::memory_order_relaxed);
  }

  uintptr_t reserve(size_t bytes) override {
    if (bytes == 0 || bytes % page_size_ != 0) {
      throw InvalidArgument("reserve: size must be a positive multiple of the page size");
    }
    ScopedContext current(context_->get());
    CUdeviceptr va = 0;
    CUresult r = driver().cuMemAddressReserve(&va, bytes, alignment_, 0, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      throw MappingLimit(call_error("cuMemAddressReserve", r) + ": the GPU virtual address space is exhausted");
    }
    check(r, "cuMemAddressReserve");
    return static_cast<uintptr_t>(va);
  }

  void release(uintptr_t va, size_t bytes) override {
    ScopedContext current(context_->get());
    check(driver().cuMemAddressFree(static_cast<CUdeviceptr>(va), bytes), "cuMemAddressFree");
  }

  // One cuMemMap per page (a mapping covers a whole handle), then a single cuMemSetAccess over the run
  // (every mapping needs access set; the call costs ~36 us whatever the length, so it is batched): one per
  // stretch of the run where imported pages (read-only access) and the pool's own (read/write) alternate.
  // map_calls() grows by n + 1 without imported pages. All or nothing: on failure what was mapped is unmapped.
  void map(uintptr_t va, const PageId* pages, size_t n) override {
    if (n == 0) return;
    for (size_t i = 0; i < n; ++i) check_readable(pages[i]);
    const Driver& d = driver();
    ScopedContext current(context_->get());
    size_t done = 0;
    size_t calls = 0;
    CUresult err = CUDA_SUCCESS;
    const char* failed = nullptr;
    for (; done < n; ++done) {
      ++calls;
      err = d.cuMemMap(static_cast<CUdeviceptr>(va + done * page_size_), page_size_, 0, handle_of(pages[done]), 0);
      if (err != CUDA_SUCCESS) {
        failed = "cuMemMap";
        break;
      }
    }
    for (size_t i = 0; failed == nullptr && i < n;) {
      const bool read_only = is_imported_page(pages[i]);
      size_t j = i + 1;
      while (j < n && is_imported_page(pages[j]) == read_only) ++j;
      ++calls;
      err = d.cuMemSetAccess(static_cast<CUdeviceptr>(va + i * page_size_), (j - i) * page_size_,
                             read_only ? &read_access_ : &access_, 1);
      if (err != CUDA_SUCCESS) failed = "cuMemSetAccess";
      i = j;
    }
    count_calls(calls, 0);
    if (failed == nullptr) return;
    if (done > 0) unmap_run(static_cast<CUdeviceptr>(va), done, nullptr, true);
    throw BackendFailure(call_error(failed, err));
  }

  // One cuMemUnmap for the run, or one per page where the driver refuses the run (see "Unmapping a run").
  // Does not wait for streams: see the protocol at the top of this file. On failure some pages of the run
  // may be unmapped and others not: the caller treats the whole run as still mapped (its pages keep their
  // references), which leaks rather than hands out a page that may still be mapped.
  void unmap(uintptr_t va, size_t n) override {
    if (n == 0) return;
    ScopedContext current(context_->get());
    check(unmap_run(static_cast<CUdeviceptr>(va), n, nullptr, true), "cuMemUnmap");
  }

  void copy_page(PageId dst, PageId src, uintptr_t stream) override {
    check_page(dst);
    check_readable(src);
    ScopedContext current(context_->get());
    check(driver().cuMemcpyDtoDAsync(window_address(dst), address_of(src), page_size_, as_stream(stream)),
          "cuMemcpyDtoDAsync");
  }

  void copy_to_host(PageId src, void* host, uintptr_t stream) override {
    check_readable(src);
    ScopedContext current(context_->get());
    check(driver().cuMemcpyDtoHAsync(host, address_of(src), page_size_, as_stream(stream)), "cuMemcpyDtoHAsync");
  }

  void copy_from_host(PageId dst, const void* host, uintptr_t stream) override {
    check_page(dst);
    ScopedContext current(context_->get());
    check(driver().cuMemcpyHtoDAsync(window_address(dst), host, page_size_, as_stream(stream)), "cuMemcpyHtoDAsync");
  }

  // Consecutive page ids are consecutive in the pool window: a run into consecutive host buffers is one copy.
  // Imported pages are consecutive in the import window as general ones are in the pool window.
  void copy_pages_to_host(const PageId* pages, char* const* host, size_t n, uintptr_t stream) override {
    for (size_t i = 0; i < n; ++i) check_readable(pages[i]);
    ScopedContext current(context_->get());
    for (size_t i = 0; i < n;) {
      size_t j = i + 1;
      while (j < n && pages[j] == pages[j - 1] + 1 && host[j] == host[j - 1] + page_size_ &&
             is_imported_page(pages[j]) == is_imported_page(pages[i]))
        ++j;
      check(driver().cuMemcpyDtoHAsync(host[i], address_of(pages[i]), (j - i) * page_size_, as_stream(stream)),
            "cuMemcpyDtoHAsync");
      i = j;
    }
  }

  void copy_pages_from_host(const PageId* pages, const char* const* host, size_t n, uintptr_t stream) override {
    for (size_t i = 0; i < n; ++i) check_page(pages[i]);
    ScopedContext current(context_->get());
    for (size_t i = 0; i < n;) {
      size_t j = i + 1;
      while (j < n && pages[j] == pages[j - 1] + 1 && host[j] == host[j - 1] + page_size_) ++j;
      check(driver().cuMemcpyHtoDAsync(window_address(pages[i]), host[i], (j - i) * page_size_, as_stream(stream)),
            "cuMemcpyHtoDAsync");
      i = j;
    }
  }

  // A device-to-device copy from the page's window address to a range's mapped address.
  bool can_copy_page_to() const override { return true; }
  void copy_page_to(uintptr_t dst, PageId src, size_t bytes, uintptr_t stream) override {
    check_readable(src);
    if (bytes > page_size_) throw InvalidArgument("copy_page_to: more bytes than a page");
    ScopedContext current(context_->get());
    check(driver().cuMemcpyDtoDAsync(static_cast<CUdeviceptr>(dst), address_of(src), bytes, as_stream(stream)),
          "cuMemcpyDtoDAsync");
  }

  bool can_share_pages() const override { return shareable_; }
  std::string share_unavailable_reason() const override { return shareable_ ? "" : unshareable_reason(); }

  int export_page(PageId page) override {
    if (!shareable_) throw InvalidArgument(device() + " pages cannot be shared: " + unshareable_reason());
    check_page(page);
    if (is_imported_page(page)) throw InvalidArgument("export_page: page " + std::to_string(page) + " is imported");
    ScopedContext current(context_->get());
    int fd = -1;
    check(driver().cuMemExportToShareableHandle(&fd, handles_[page].load(std::memory_order_acquire),
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle");
    return fd;
  }

  // Each descriptor: import, check the allocation is on this device, map into a free slot of the import window
  // with read-only access. A slot is taken only once every step for it worked; a failure undoes the imports so far.
  void import_pages(const int* fds, size_t n, PageId* out) override {
    if (!shareable_) throw InvalidArgument(device() + " pages cannot be shared: " + unshareable_reason());
    if (n == 0) return;
    std::lock_guard<std::mutex> lock(import_mu_);
    const Driver& d = driver();
    ScopedContext current(context_->get());
    const bool reserved_here = import_window_ == 0;
    if (reserved_here) {
      CUdeviceptr window = 0;
      check(d.cuMemAddressReserve(&window, import_capacity_ * page_size_, alignment_, 0, 0),
            "cuMemAddressReserve(import window)");
      import_window_ = window;
    }
    std::vector<size_t> taken;
    auto undo = [&] {  // as before the call: the imports so far go, and a window reserved for them
      for (size_t slot : taken) release_slot_locked(slot);
      if (imports_ == 0 && reserved_here) {
        d.cuMemAddressFree(import_window_, import_capacity_ * page_size_);
        import_window_ = 0;
      }
    };
    for (size_t i = 0; i < n; ++i) {
      size_t slot = 0;
      while (slot < import_capacity_ && imported_[slot].load(std::memory_order_relaxed) != 0) ++slot;
      if (slot == import_capacity_) {
        undo();
        throw OutOfPages("import_pages: " + std::to_string(import_capacity_) +
                         " imported pages are held already (a pool holds at most " + std::to_string(kMinImportSlots) +
                         " or its capacity of them, whichever is more)");
      }
      CUmemGenericAllocationHandle h = 0;
      CUresult r = d.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fds[i])),
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      if (r != CUDA_SUCCESS) {
        undo();
        throw InvalidArgument(
            "import_pages: descriptor " + std::to_string(fds[i]) +
            " is not a shareable CUDA allocation: " + call_error("cuMemImportFromShareableHandle", r));
      }
      CUmemAllocationProp prop{};
      r = d.cuMemGetAllocationPropertiesFromHandle(&prop, h);
      const CUdeviceptr at = import_window_ + static_cast<CUdeviceptr>(slot) * page_size_;
      std::string problem;
      if (r != CUDA_SUCCESS) {
        problem = call_error("cuMemGetAllocationPropertiesFromHandle", r);
      } else if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device_) {
        problem = "the allocation is not on " + device();
      } else if ((r = d.cuMemMap(at, page_size_, 0, h, 0)) != CUDA_SUCCESS) {
        problem = "it does not map as one page of " + std::to_string(page_size_) + " bytes (" +
                  call_error("cuMemMap", r) + ")";
      } else if ((r = d.cuMemSetAccess(at, page_size_, &read_access_, 1)) != CUDA_SUCCESS) {
        d.cuMemUnmap(at, page_size_);
        d.cuMemRelease(h);
        undo();
        throw BackendFailure(call_error("cuMemSetAccess(import window)", r));
      }
      if (!problem.empty()) {
        d.cuMemRelease(h);
        undo();
        throw InvalidArgument("import_pages: descriptor " + std::to_string(fds[i]) + ": " + problem);
      }
      imported_[slot].store(h, std::memory_order_release);
      ++imports_;
      taken.push_back(slot);
      out[i] = static_cast<PageId>(capacity_pages_ + slot);
      if (slot + 1 > import_slots_.load(std::memory_order_relaxed))
        import_slots_.store(slot + 1, std::memory_order_release);
    }
  }

  void release_imported_page(PageId page) noexcept override {
    if (!is_imported_page(page)) return;
    try {
      std::lock_guard<std::mutex> lock(import_mu_);
      ScopedContext current(context_->get());
      release_slot_locked(static_cast<size_t>(page) - capacity_pages_);
    } catch (...) {  // no current context could be made: the handle stays until the backend goes
    }
  }

  bool is_imported_page(PageId page) const override {
    return page >= static_cast<PageId>(capacity_pages_) &&
           static_cast<size_t>(page) < capacity_pages_ + import_capacity_ &&
           imported_[static_cast<size_t>(page) - capacity_pages_].load(std::memory_order_acquire) != 0;
  }

  void synchronize(uintptr_t stream) override {
    ScopedContext current(context_->get());
    check(driver().cuStreamSynchronize(as_stream(stream)), "cuStreamSynchronize");
  }

  // Every stream of the primary context torch uses, including streams vpaged never saw. While a stream
  // captures a CUDA graph the driver refuses the wait (and, in the global capture mode torch.cuda.graph uses
  // by default, invalidates the capture): that is CaptureActive, so that callers can defer what waited.
  void synchronize_device() override {
    ScopedContext current(context_->get());
    const CUresult r = driver().cuCtxSynchronize();
    if (is_capture_error(r)) throw CaptureActive(call_error("cuCtxSynchronize", r));
    check(r, "cuCtxSynchronize");
  }

  // cuStreamIsCapturing: any status but NONE (ACTIVE, or INVALIDATED: a capture that is still to be ended)
  // counts; for the legacy stream CUDA_ERROR_STREAM_CAPTURE_IMPLICIT says a blocking stream captures in the
  // global mode. Another error (a destroyed stream, a sticky error) answers false: the wait that follows
  // then reports what is wrong.
  bool capturing(uintptr_t stream) override {
    try {
      ScopedContext current(context_->get());
      CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
      const CUresult r = driver().cuStreamIsCapturing(as_stream(stream), &status);
      if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
      return r == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
    } catch (const std::exception&) {
      return false;
    }
  }

 private:
  static CUstream as_stream(uintptr_t stream) { return reinterpret_cast<CUstream>(stream); }
  // The errors a device-wide wait returns because a stream is capturing a graph.
  static bool is_capture_error(CUresult r) {
    return r == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED || r == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED ||
           r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT || r == CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
  }
  CUdeviceptr window_address(PageId page) const { return window_ + static_cast<CUdeviceptr>(page) * page_size_; }
  // Where a readable page (general or imported) is mapped in this backend's own windows.
  CUdeviceptr address_of(PageId page) const {
    if (!is_imported_page(page)) return window_address(page);
    return import_window_ + static_cast<CUdeviceptr>(static_cast<size_t>(page) - capacity_pages_) * page_size_;
  }
  CUmemGenericAllocationHandle handle_of(PageId page) const {
    if (is_imported_page(page))
      return imported_[static_cast<size_t>(page) - capacity_pages_].load(std::memory_order_acquire);
    return handles_[page].load(std::memory_order_acquire);
  }
  // A page that may be read or mapped: a general page with memory, or an imported one (read-only).
  void check_readable(PageId page) const {
    if (!is_imported_page(page)) check_page(page);
  }
  // Caller holds import_mu_ and a current context. The slot's mapping goes, then its handle.
  void release_slot_locked(size_t slot) noexcept {
    const CUmemGenericAllocationHandle h = imported_[slot].exchange(0, std::memory_order_acq_rel);
    if (h == 0) return;
    --imports_;
    driver().cuMemUnmap(import_window_ + static_cast<CUdeviceptr>(slot) * page_size_, page_size_);
    driver().cuMemRelease(h);
  }
  std::string unshareable_reason() const {
    const char* off = std::getenv("VPAGED_CUDA_SHAREABLE_PAGES");
    if (off != nullptr && std::strcmp(off, "0") == 0) return "VPAGED_CUDA_SHAREABLE_PAGES=0";
    return "the device does not support POSIX file-descriptor handles";
  }
  // Whether pages are made shareable: the device supports POSIX fd handles, and the user did not turn it off.
  static bool posix_fd_handles(CUdevice dev) {
    const char* off = std::getenv("VPAGED_CUDA_SHAREABLE_PAGES");
    if (off != nullptr && std::strcmp(off, "0") == 0) return false;
    int supported = 0;
    const CUresult r =
        driver().cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
    return r == CUDA_SUCCESS && supported != 0;
  }

  // Only created pages that were not released since have a handle and a window mapping.
  bool in_window(PageId page) const {
    return page >= 0 && static_cast<size_t>(page) < created_.load(std::memory_order_acquire);
  }
  bool has_memory(PageId page) const { return in_window(page) && handles_[page].load(std::memory_order_acquire) != 0; }
  void check_page(PageId page) const {
    if (is_imported_page(page)) {
      throw InvalidArgument("page id " + std::to_string(page) +
                            " is an imported page: read-only (copy it before writing: copy-on-write)");
    }
    if (!in_window(page)) {
      throw InvalidArgument("page id " + std::to_string(page) + " out of range (" + std::to_string(page_ids()) +
                            " pages created)");
    }
    if (!has_memory(page)) {
      throw InvalidArgument("page id " + std::to_string(page) +
                            " has no memory: it was released while free (PagePool.trim) and not handed out since");
    }
  }
  // The end of the run of consecutive ids that starts at ids[i] (ids sorted).
  static size_t run_end(const std::vector<PageId>& ids, size_t i) {
    size_t j = i + 1;
    while (j < ids.size() && ids[j] == ids[j - 1] + 1) ++j;
    return j;
  }

  // map_calls_ / unmap_calls_ are atomic in Backend: ranges on several threads may map at once.
  void count_calls(size_t maps, size_t unmaps) {
    map_calls_ += maps;
    unmap_calls_ += unmaps;
  }

  // Unmap n pages from va, each its own mapping, with a current context: one cuMemUnmap for the run, and if
  // the driver refuses it (a run of several mappings, see "Unmapping a run"), one call per page, the refusal
  // counted in unmap_fallbacks_. unmapped (n entries, or null) marks the pages that are unmapped now. Returns
  // CUDA_SUCCESS when every page is, else the first error. counted: the calls go into unmap_calls().
  CUresult unmap_run(CUdeviceptr va, size_t n, char* unmapped, bool counted) noexcept {
    const Driver& d = driver();
    CUresult r = d.cuMemUnmap(va, n * page_size_);
    if (counted) count_calls(0, 1);
    if (r == CUDA_SUCCESS || n == 1) {
      if (unmapped != nullptr && r == CUDA_SUCCESS) std::fill(unmapped, unmapped + n, 1);
      return r;
    }
    unmap_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    CUresult first_error = CUDA_SUCCESS;
    for (size_t k = 0; k < n; ++k) {
      const CUresult rk = d.cuMemUnmap(va + static_cast<CUdeviceptr>(k) * page_size_, page_size_);
      if (counted) count_calls(0, 1);
      if (rk == CUDA_SUCCESS) {
        if (unmapped != nullptr) unmapped[k] = 1;
      } else if (first_error == CUDA_SUCCESS) {
        first_error = rk;
      }
    }
    return first_error;
  }

  // Undo everything the constructor did; safe on a partly built object and never throws. At process
  // exit the driver may already be torn down: its calls then fail and there is nothing left to free.
  void free_all() noexcept {
    if (!context_) return;
    const Driver& d = driver();
    try {
      ScopedContext current(context_->get());
      const size_t made = created_.load(std::memory_order_acquire);
      // The window is mapped where ids have memory: one unmap per run of such ids (released ones are holes).
      for (size_t i = 0; i < made;) {
        if (!has_memory(static_cast<PageId>(i))) {
          ++i;
          continue;
        }
        size_t j = i + 1;
        while (j < made && has_memory(static_cast<PageId>(j))) ++j;
        unmap_run(window_address(static_cast<PageId>(i)), j - i, nullptr, false);
        i = j;
      }
      for (size_t i = 0; i < made; ++i)
        if (const CUmemGenericAllocationHandle h = handles_[i].exchange(0)) d.cuMemRelease(h);
      if (window_ != 0) d.cuMemAddressFree(window_, capacity_pages_ * page_size_);
      if (import_window_ != 0) {
        for (size_t slot = 0; slot < import_capacity_; ++slot) release_slot_locked(slot);
        d.cuMemAddressFree(import_window_, import_capacity_ * page_size_);
      }
    } catch (...) {
    }
    created_.store(0);
    backed_.store(0);
    window_ = 0;
    import_window_ = 0;
    import_slots_.store(0);
    context_.reset();  // cuDevicePrimaryCtxRelease
  }

  int device_;
  CUdevice dev_ = 0;
  size_t page_size_;
  size_t capacity_pages_;
  size_t alignment_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  CUmemAccessDesc read_access_{};  // imported pages: read-only
  bool shareable_ = false;         // pages are made with POSIX fd handles requested (export_page / import_pages)
  std::unique_ptr<PrimaryContext> context_;
  CUdeviceptr window_ = 0;  // capacity_pages_ * page_size_ of VA; page id i is mapped at i * page_size_
  std::unique_ptr<std::atomic<CUmemGenericAllocationHandle>[]> handles_;  // 0: no memory (not created, released)
  std::atomic<size_t> created_{0};  // ids 0..created_-1 exist (have a window address)
  std::atomic<size_t> backed_{0};   // of those, the ones with a live handle
  std::mutex create_mu_;
  // Imported pages: slot k is id capacity_pages_ + k, mapped read-only at import_window_ + k * page_size_.
  size_t import_capacity_ = 0;                                             // slots of the import window
  std::unique_ptr<std::atomic<CUmemGenericAllocationHandle>[]> imported_;  // 0: slot free
  CUdeviceptr import_window_ = 0;        // reserved at the first import (under import_mu_), freed with the backend
  std::atomic<size_t> import_slots_{0};  // slots ever used: ids capacity_pages_ .. capacity_pages_ + this - 1
  size_t imports_ = 0;                   // slots in use (under import_mu_)
  std::mutex import_mu_;
};

}  // namespace

bool built_with_cuda() { return true; }

std::string cuda_unavailable_reason(int device) {
  try {
    return device_problem(device);
  } catch (const std::exception& e) {
    return e.what();
  }
}

int cuda_device_count() {
  const Driver& d = driver();
  int count = 0;
  if (!d.unavailable.empty() || d.cuDeviceGetCount(&count) != CUDA_SUCCESS) return 0;
  return count;
}

size_t cuda_granularity(int device) {
  if (!device_problem(device).empty()) return 0;
  const Driver& d = driver();
  const CUmemAllocationProp prop = page_properties(device);
  size_t granularity = 0;
  CUresult r = d.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    // Some drivers want a current context for the query: borrow the primary one for it.
    try {
      CUdevice dev = 0;
      check(d.cuDeviceGet(&dev, device), "cuDeviceGet");
      PrimaryContext ctx(dev);
      ScopedContext current(ctx.get());
      r = d.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    } catch (const std::exception&) {
      return 0;
    }
  }
  return r == CUDA_SUCCESS ? granularity : 0;
}

std::shared_ptr<Backend> make_cuda_backend(int device, size_t page_size, size_t capacity_pages, size_t reserve_pages) {
  return std::make_shared<CudaBackend>(device, page_size, capacity_pages, reserve_pages);
}

bool cuda_primary_context_held(int device) {
  const Driver& d = driver();
  CUdevice dev = 0;
  if (!d.unavailable.empty() || d.cuDeviceGet(&dev, device) != CUDA_SUCCESS) return false;
  std::lock_guard<std::mutex> lock(process_contexts_mu);
  return std::find(process_contexts.begin(), process_contexts.end(), dev) != process_contexts.end();
}

}  // namespace vpaged

#endif  // VPAGED_WITH_CUDA
