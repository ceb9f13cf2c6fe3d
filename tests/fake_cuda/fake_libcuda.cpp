// A fake CUDA driver (libcuda.so.1) for vpaged's tests on machines without a GPU.
//
// It implements, on host memory, the driver entry points that csrc/backends/cuda_backend.cpp resolves, so
// that the backend's own logic (entry-point resolution, availability reasons, context handling, pool
// window, batching of cuMemSetAccess, all-or-nothing mapping, error paths, teardown) runs in CI:
//
//   physical allocation (cuMemCreate)     a memfd of the allocation's size (sparse until written)
//   address reservation (cuMemAddressReserve)  a PROT_NONE anonymous mmap, aligned to the granularity
//   mapping (cuMemMap)                    mmap(MAP_SHARED | MAP_FIXED) of the memfd, still PROT_NONE
//   access (cuMemSetAccess)               mprotect(PROT_READ | PROT_WRITE), or PROT_READ for read-only access
//   sharing (cuMemExportToShareableHandle /  a POSIX file descriptor of the allocation's memfd, which another
//     cuMemImportFromShareableHandle)     process (receiving it over a Unix socket) imports: the same bytes
//   unmapping (cuMemUnmap)                the range goes back to a PROT_NONE anonymous mapping
//   copies (cuMemcpy*Async)               queued on their stream (the NULL / legacy stream of the current
//                                         context's device, or a stream of the tests made by
//                                         fake_cuda_stream_create), done only when that stream is synchronized
//                                         (cuStreamSynchronize, or cuCtxSynchronize for every stream of the device)
//   kernels (fake_cuda_launch_read)       a queued read of a device range, done at the stream's sync
//   graph capture (fake_cuda_begin_capture[_mode] / fake_cuda_end_capture)  a test stream marked as capturing
//                                         in a capture mode (global by default, as torch.cuda.graph): see
//                                         "Capture rules" below; fake_cuda_end_capture reports a capture a call
//                                         broke as CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
//
// Strict where the real driver is (tests/memory/test_cuda_backend_fake.py runs every check so):
//   * cuMemRelease of a handle that is still mapped only marks it released: its bytes stay allocated (and
//     count against the memory limit) until its last mapping is unmapped, as the driver frees them.
//   * cuMemUnmap must name exactly one whole mapping: a range over several separate mappings is refused with
//     CUDA_ERROR_INVALID_VALUE ("the range must be the entire contiguous address range that was mapped to").
//     Not a violation (vpaged falls back to one call per page); counted (fake_cuda_live("refused_unmaps")).
//     FAKE_CUDA_MULTI_UNMAP=1 models a driver that accepts a run of whole mappings in one call (the checks of
//     the one-call-per-run path use it).
//   * Capture rules: while a capture runs in the global mode, cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap
//     and cuMemSetAccess from ANY thread (in the thread-local mode: from the capturing thread) are refused
//     with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the capture; a violation. cuCtxSynchronize,
//     and cuStreamSynchronize of a capturing stream or (global mode) of the legacy stream, fail the same way
//     and invalidate it (not violations: the caller cannot always know a capture runs).
//   * cuStreamIsCapturing on the legacy stream answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT while a global-mode
//     capture runs (the legacy stream may not be used then).
//   * The legacy stream's copies are asynchronous, as on a device: reading their result before the stream is
//     synchronized reads stale bytes, and unmapping their memory first faults (sticky).
//
// Streams made by fake_cuda_stream_create behave like torch's (created non-blocking): work on them is
// ordered neither with the legacy stream nor with each other, so a missing cuStreamSynchronize shows as
// stale data. Queued work that touches memory unmapped before it ran is an illegal address: as on a GPU,
// the error is sticky for the context, and every later call in that context returns
// CUDA_ERROR_ILLEGAL_ADDRESS (fake_cuda_clear_sticky_error stands in for the process restart the real
// driver needs).
//
// So a "device pointer" handed out by vpaged is a host address the tests can read and write (through
// ctypes or numpy), two mappings of one allocation see the same bytes, and touching memory that the
// driver would fault on (unmapped, or mapped without access) is a SIGSEGV here too.
//
// The fake is strict where the real driver is: every rule it enforces is commented at its check, with
// the return code the driver documents. A rejected call that means vpaged misused the API also counts as
// a "violation" (fake_cuda_violations), which the tests require to stay at zero. Errors the tests cause
// on purpose (injected failures, the memory limit) are not violations.
//
// Only cuGetProcAddress_v2 and the fake_cuda_* test hooks are exported: vpaged must reach every other
// entry point through cuGetProcAddress, as it does with the real driver.
//
// cuMemGetAllocationGranularity: the driver API reference lists no context error for it, so by default
// the fake answers without a current context; FAKE_CUDA_GRANULARITY_NEEDS_CONTEXT=1 models a driver that
// wants one anyway (vpaged then borrows the primary context).
//
// Configuration, read from the environment at first use (the tests start each check in a fresh process):
//   FAKE_CUDA_NO_DEVICE=1            cuInit fails with CUDA_ERROR_NO_DEVICE (a driver but no GPU)
//   FAKE_CUDA_DEVICES=N              number of devices (default 1)
//   FAKE_CUDA_VMM=0                  devices report no virtual memory management support
//   FAKE_CUDA_GRANULARITY=BYTES      allocation granularity (default 2 MiB, as on A100/H100/H200)
//   FAKE_CUDA_GRANULARITY_NEEDS_CONTEXT=1  cuMemGetAllocationGranularity wants a current context
//   FAKE_CUDA_DRIVER_VERSION=V       CUDA version the driver supports (default 13000)
//   FAKE_CUDA_MISSING=a,b            entry points cuGetProcAddress does not find
//   FAKE_CUDA_MULTI_UNMAP=1          cuMemUnmap accepts a run of several whole mappings in one call
//   FAKE_CUDA_POSIX_FD=0             devices report no POSIX file-descriptor handles (no shareable pages)
// Build: g++ -std=c++17 -shared -fPIC -fvisibility=hidden -I<cuda>/include fake_libcuda.cpp
//        -Wl,-soname,libcuda.so.1 -o <dir>/libcuda.so.1   (tests/test_cuda_backend_fake.py does this)
#include <cuda.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdio>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#define FAKE_EXPORT extern "C" __attribute__((visibility("default")))

// cuda.h leaves the context type opaque; the fake's contexts are the devices' primary contexts.
struct CUctx_st {
  int device;
};

namespace {

constexpr int kMaxDevices = 16;

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::strtol(v, nullptr, 0) : fallback;
}

struct Config {
  bool no_device = false;
  int devices = 1;
  bool vmm = true;
  size_t granularity = 2u << 20;
  bool granularity_needs_context = false;
  int driver_version = 13000;
  bool multi_unmap = false;
  bool posix_fd = true;
  std::set<std::string> missing;
};

Config read_config() {
  Config c;
  c.no_device = env_long("FAKE_CUDA_NO_DEVICE", 0) != 0;
  c.devices = static_cast<int>(env_long("FAKE_CUDA_DEVICES", 1));
  if (c.devices < 0) c.devices = 0;
  if (c.devices > kMaxDevices) c.devices = kMaxDevices;
  c.vmm = env_long("FAKE_CUDA_VMM", 1) != 0;
  c.granularity = static_cast<size_t>(env_long("FAKE_CUDA_GRANULARITY", 2l << 20));
  c.granularity_needs_context = env_long("FAKE_CUDA_GRANULARITY_NEEDS_CONTEXT", 0) != 0;
  c.driver_version = static_cast<int>(env_long("FAKE_CUDA_DRIVER_VERSION", 13000));
  c.multi_unmap = env_long("FAKE_CUDA_MULTI_UNMAP", 0) != 0;
  c.posix_fd = env_long("FAKE_CUDA_POSIX_FD", 1) != 0;
  if (const char* m = std::getenv("FAKE_CUDA_MISSING")) {
    std::stringstream names(m);
    std::string name;
    while (std::getline(names, name, ',')) c.missing.insert(name);
  }
  return c;
}

// One cuMemCreate or cuMemImportFromShareableHandle handle, holding memory until released and unmapped
// everywhere. Its memfd is named after its device ("fake-cuda-allocation-dN"), so that an import knows where the
// memory lies, as the real driver does.
struct Allocation {
  int fd;
  size_t size;
  int device;
  bool shareable = false;  // created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested: exportable
  bool imported = false;   // made by an import: the exporter's memory (not counted in bytes_allocated)
  int mappings = 0;        // live cuMemMap mappings of this handle
  bool released = false;   // cuMemRelease was called: the memory goes with the last mapping
};

struct Mapping {  // one cuMemMap
  size_t size;
  CUmemGenericAllocationHandle handle;
  bool accessible;  // cuMemSetAccess has granted read access (read-only or read/write)
  bool writable;    // ... and write access
};

// A copy or kernel queued on a stream of the tests, run when the stream is synchronized.
struct PendingOp {
  enum Kind { kHtoD, kDtoH, kDtoD, kRead } kind;
  uintptr_t dst;  // device address (kHtoD, kDtoD) or host address (kDtoH); unused for kRead
  uintptr_t src;  // device address (kDtoH, kDtoD, kRead) or host address (kHtoD)
  size_t bytes;
};

// cudaStreamCaptureMode: which threads' unsafe calls break a capture (global: any thread's).
enum CaptureMode { kCaptureGlobal = 0, kCaptureThreadLocal = 1, kCaptureRelaxed = 2 };

struct FakeStream {  // made by fake_cuda_stream_create (or a device's legacy stream); one device's context
  int device;
  std::vector<PendingOp> queue;
  bool capturing = false;    // between fake_cuda_begin_capture and fake_cuda_end_capture
  bool invalidated = false;  // a call during the capture broke it
  int mode = kCaptureGlobal;
  std::thread::id capture_thread;  // the thread that began the capture (thread-local mode)
};

struct InjectedFailure {
  long skip;  // calls that still succeed before the failing one
  CUresult result;
};

// All driver state. Heap-allocated and never destroyed: vpaged may call the driver while the process
// exits, after static destructors would have run.
struct State {
  std::mutex mu;
  bool config_read = false;
  Config cfg;
  bool initialized = false;  // cuInit succeeded
  CUctx_st contexts[kMaxDevices];
  int primary_refs[kMaxDevices] = {};
  std::map<CUmemGenericAllocationHandle, Allocation> allocations;
  CUmemGenericAllocationHandle next_handle = 1;
  size_t bytes_allocated = 0;
  long long memory_limit = -1;               // bytes of allocations the "device" holds; < 0: no limit
  std::map<uintptr_t, size_t> reservations;  // start -> size
  std::map<uintptr_t, Mapping> mappings;     // start -> mapping
  std::map<std::string, long> calls;
  std::map<std::string, InjectedFailure> failures;
  FakeStream legacy[kMaxDevices];  // each device's legacy (NULL) stream: its copies queue as on any stream
  long refused_unmaps = 0;         // cuMemUnmap calls refused for spanning several mappings
  long violations = 0;
  std::string last_violation;
  std::map<CUstream, FakeStream*> streams;  // streams of the tests (never freed: handles stay unique)
  CUresult sticky[kMaxDevices] = {};        // a context's sticky error (CUDA_SUCCESS: none)
  unsigned long long last_proc_flags = ~0ull;
  int last_proc_version = -1;
};

State& state() {
  static State* s = [] {
    auto* st = new State;
    for (int i = 0; i < kMaxDevices; ++i) st->contexts[i].device = i, st->legacy[i].device = i;
    return st;
  }();
  return *s;
}

const Config& config(State& s) {
  if (!s.config_read) {
    s.cfg = read_config();
    s.config_read = true;
  }
  return s.cfg;
}

// The calling thread's context stack (cuCtxPushCurrent / cuCtxPopCurrent); its top is current.
thread_local std::vector<CUcontext> context_stack;

// Every entry point starts here, under the state lock: count the call, then fire an injected failure
// if one is due for this entry point.
CUresult enter(State& s, const char* name) {
  ++s.calls[name];
  auto it = s.failures.find(name);
  if (it == s.failures.end()) return CUDA_SUCCESS;
  if (it->second.skip > 0) {
    --it->second.skip;
    return CUDA_SUCCESS;
  }
  CUresult r = it->second.result;
  s.failures.erase(it);
  return r;
}

// A call the real driver would refuse because the caller broke one of its rules.
CUresult violation(State& s, const char* call, CUresult result, const std::string& rule) {
  ++s.violations;
  s.last_violation = std::string(call) + ": " + rule;
  return result;
}

// Every entry point begins with ENTER (lock, count, injected failure) and refuses a bad call with
// REFUSE(result, rule), which records the violation.
#define ENTER(name)                                    \
  State& s = state();                                  \
  std::lock_guard<std::mutex> lock(s.mu);              \
  [[maybe_unused]] const char* const call_name = name; \
  if (CUresult injected = enter(s, call_name)) return injected

#define REFUSE(result, rule) return violation(s, call_name, result, rule)

// Rule: every call other than cuInit, cuGetErrorName/String and cuGetProcAddress needs cuInit first.
#define NEED_INIT                                                                             \
  do {                                                                                        \
    if (!s.initialized) REFUSE(CUDA_ERROR_NOT_INITIALIZED, "called before cuInit succeeded"); \
  } while (0)

// Rule: memory and stream calls act on the calling thread's current context; without one they return
// CUDA_ERROR_INVALID_CONTEXT. A primary context whose last reference was released is no longer active.
#define NEED_CONTEXT                                                                                           \
  do {                                                                                                         \
    NEED_INIT;                                                                                                 \
    if (context_stack.empty() || context_stack.back() == nullptr)                                              \
      REFUSE(CUDA_ERROR_INVALID_CONTEXT, "no current context on the calling thread");                          \
    if (s.primary_refs[context_stack.back()->device] <= 0)                                                     \
      REFUSE(CUDA_ERROR_CONTEXT_IS_DESTROYED, "the current context was released");                             \
    if (s.sticky[context_stack.back()->device] != CUDA_SUCCESS) return s.sticky[context_stack.back()->device]; \
  } while (0)

bool valid_device(State& s, int ordinal) { return ordinal >= 0 && ordinal < config(s).devices; }

// Rule (cuMemCreate, cuMemGetAllocationGranularity): vpaged's pages are pinned device memory on one
// existing device; anything else is outside what the fake (and vpaged) models.
bool device_pinned_prop(State& s, const CUmemAllocationProp* prop) {
  return prop != nullptr && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
         prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && valid_device(s, prop->location.id);
}

// The mapping that contains address p, or mappings.end().
std::map<uintptr_t, Mapping>::iterator mapping_at(State& s, uintptr_t p) {
  auto it = s.mappings.upper_bound(p);
  if (it == s.mappings.begin()) return s.mappings.end();
  --it;
  return p < it->first + it->second.size ? it : s.mappings.end();
}

// True when [p, p + size) is exactly a sequence of whole, adjacent mappings.
bool whole_mappings(State& s, uintptr_t p, size_t size) {
  if (size == 0) return false;
  uintptr_t at = p;
  while (at < p + size) {
    auto it = s.mappings.find(at);
    if (it == s.mappings.end()) return false;
    at += it->second.size;
  }
  return at == p + size;
}

// True when every byte of [p, p + size) lies in mappings that have been granted access (write access too, for
// `write`).
bool accessible(State& s, uintptr_t p, size_t size, bool write = false) {
  uintptr_t at = p;
  while (at < p + size) {
    auto it = mapping_at(s, at);
    if (it == s.mappings.end() || !it->second.accessible || (write && !it->second.writable)) return false;
    at = it->first + it->second.size;
  }
  return true;
}

bool inside_one_reservation(State& s, uintptr_t p, size_t size) {
  auto it = s.reservations.upper_bound(p);
  if (it == s.reservations.begin()) return false;
  --it;
  return p >= it->first && p + size <= it->first + it->second;
}

bool legacy_stream(CUstream stream) { return stream == nullptr || stream == CU_STREAM_LEGACY; }

// Rule (copies, synchronize): a stream is the NULL / legacy one or one made by the tests and not yet
// destroyed (vpaged passes the caller's stream through).
bool known_stream(State& s, CUstream stream) { return legacy_stream(stream) || s.streams.count(stream) != 0; }

// The stream a handle names for the calling thread: a test stream, or its current device's legacy stream.
FakeStream& stream_of(State& s, CUstream stream) {
  if (!legacy_stream(stream)) return *s.streams.at(stream);
  const int device = context_stack.empty() || context_stack.back() == nullptr ? 0 : context_stack.back()->device;
  return s.legacy[device];
}

// Whether a capture in the global mode runs on any stream (of any device: the mode is process-wide).
bool global_capture_running(State& s) {
  for (auto& [handle, st] : s.streams)
    if (st->capturing && st->mode == kCaptureGlobal) return true;
  return false;
}

// Capture rule: an unsafe call (the VMM calls that change memory or mappings) while a capture runs in the
// global mode, from any thread, or in the thread-local mode from the capturing thread, is refused with
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates that capture. Returns true when the call is refused.
bool breaks_capture(State& s) {
  bool broke = false;
  for (auto& [handle, st] : s.streams) {
    if (!st->capturing) continue;
    if (st->mode == kCaptureGlobal ||
        (st->mode == kCaptureThreadLocal && st->capture_thread == std::this_thread::get_id())) {
      st->invalidated = true;
      broke = true;
    }
  }
  return broke;
}

#define NO_CAPTURE                                                                                            \
  do {                                                                                                        \
    if (breaks_capture(s))                                                                                    \
      REFUSE(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,                                                           \
             "called while a CUDA graph capture runs (global mode: from any thread); the capture is broken"); \
  } while (0)

// Queued work faulted: the context's error is sticky from now on (recorded as a violation: it means the
// caller unmapped memory that work still queued on a stream was going to touch).
void fault(State& s, FakeStream& st, const std::string& what) {
  s.sticky[st.device] = CUDA_ERROR_ILLEGAL_ADDRESS;
  st.queue.clear();
  ++s.violations;
  s.last_violation = "illegal address: " + what;
}

bool overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn) { return a < b + bn && b < a + an; }

// Runs a stream's queued work in order. Device ranges are checked as the work runs, not as it was
// queued: memory unmapped in between faults (sticky).
void drain(State& s, FakeStream& st) {
  for (const PendingOp& op : st.queue) {
    const bool dst_device = op.kind == PendingOp::kHtoD || op.kind == PendingOp::kDtoD;
    const bool src_device = op.kind != PendingOp::kHtoD;
    if ((dst_device && !accessible(s, op.dst, op.bytes, true)) || (src_device && !accessible(s, op.src, op.bytes))) {
      fault(s, st, "queued work ran on a device range that is no longer mapped");
      return;
    }
    if (op.kind != PendingOp::kRead)
      std::memmove(reinterpret_cast<void*>(op.dst), reinterpret_cast<const void*>(op.src), op.bytes);
  }
  st.queue.clear();
}

// Unmapping [ptr, ptr + size) while work queued on a stream still touches it: that work faults (on a
// GPU it may already be running; the unmap itself succeeds, the error surfaces at later calls).
void fault_queued_work_in(State& s, uintptr_t ptr, size_t size) {
  std::vector<FakeStream*> all;
  for (auto& [handle, st] : s.streams) all.push_back(st);
  for (FakeStream& st : s.legacy) all.push_back(&st);
  for (FakeStream* st : all) {
    for (const PendingOp& op : st->queue) {
      const bool dst_device = op.kind == PendingOp::kHtoD || op.kind == PendingOp::kDtoD;
      const bool src_device = op.kind != PendingOp::kHtoD;
      if ((dst_device && overlaps(op.dst, op.bytes, ptr, size)) ||
          (src_device && overlaps(op.src, op.bytes, ptr, size))) {
        fault(s, *st, "memory unmapped while work queued on a stream still used it");
        break;
      }
    }
  }
}

// A copy is queued on its stream, the legacy one included (checked now for mapped memory, as the driver
// validates device pointers when the call is made, and again when it runs).
CUresult submit_copy(State& s, CUstream stream, PendingOp op) {
  FakeStream& st = stream_of(s, stream);
  if (s.sticky[st.device] != CUDA_SUCCESS) return s.sticky[st.device];
  st.queue.push_back(op);
  return CUDA_SUCCESS;
}

// --------------------------------------------------------------------------------------------------
// Entry points.

CUresult fake_cuGetErrorName(CUresult error, const char** out) {
  const char* name = nullptr;
  switch (error) {
#define NAME(e) \
  case e:       \
    name = #e;  \
    break;
    NAME(CUDA_SUCCESS)
    NAME(CUDA_ERROR_INVALID_VALUE)
    NAME(CUDA_ERROR_OUT_OF_MEMORY)
    NAME(CUDA_ERROR_NOT_INITIALIZED)
    NAME(CUDA_ERROR_NO_DEVICE)
    NAME(CUDA_ERROR_INVALID_DEVICE)
    NAME(CUDA_ERROR_INVALID_CONTEXT)
    NAME(CUDA_ERROR_CONTEXT_IS_DESTROYED)
    NAME(CUDA_ERROR_INVALID_HANDLE)
    NAME(CUDA_ERROR_NOT_FOUND)
    NAME(CUDA_ERROR_NOT_SUPPORTED)
    NAME(CUDA_ERROR_NOT_PERMITTED)
    NAME(CUDA_ERROR_ILLEGAL_ADDRESS)
    NAME(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    NAME(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    NAME(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    NAME(CUDA_ERROR_UNKNOWN)
#undef NAME
    default:
      break;
  }
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *out = name;
  return name ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult fake_cuGetErrorString(CUresult error, const char** out) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *out = error == CUDA_SUCCESS ? "no error" : "error reported by the fake CUDA driver of vpaged's tests";
  return CUDA_SUCCESS;
}

CUresult fake_cuInit(unsigned int flags) {
  ENTER("cuInit");
  // Rule: flags must be 0.
  if (flags != 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  // A driver with no GPU fails cuInit itself with CUDA_ERROR_NO_DEVICE.
  if (config(s).no_device) return CUDA_ERROR_NO_DEVICE;
  s.initialized = true;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGetCount(int* count) {
  ENTER("cuDeviceGetCount");
  NEED_INIT;
  if (count == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null count");
  *count = config(s).devices;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGet(CUdevice* device, int ordinal) {
  ENTER("cuDeviceGet");
  NEED_INIT;
  // Rule: the ordinal must name a visible device (CUDA_ERROR_INVALID_DEVICE otherwise).
  if (device == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null device");
  if (!valid_device(s, ordinal)) REFUSE(CUDA_ERROR_INVALID_DEVICE, "no device " + std::to_string(ordinal));
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  ENTER("cuDeviceGetAttribute");
  NEED_INIT;
  if (value == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null value");
  if (!valid_device(s, device)) REFUSE(CUDA_ERROR_INVALID_DEVICE, "no device " + std::to_string(device));
  if (attribute == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) {
    *value = config(s).vmm ? 1 : 0;
    return CUDA_SUCCESS;
  }
  if (attribute == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) {
    *value = config(s).posix_fd ? 1 : 0;
    return CUDA_SUCCESS;
  }
  // Not a driver rule: the fake models one attribute; extend it when vpaged queries another.
  REFUSE(CUDA_ERROR_NOT_SUPPORTED, "attribute " + std::to_string(attribute) + " is not modelled by the fake");
}

CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
  ENTER("cuDevicePrimaryCtxRetain");
  NEED_INIT;
  if (ctx == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null context pointer");
  if (!valid_device(s, device)) REFUSE(CUDA_ERROR_INVALID_DEVICE, "no device " + std::to_string(device));
  ++s.primary_refs[device];
  *ctx = &s.contexts[device];
  return CUDA_SUCCESS;
}

CUresult fake_cuDevicePrimaryCtxRelease(CUdevice device) {
  ENTER("cuDevicePrimaryCtxRelease");
  NEED_INIT;
  if (!valid_device(s, device)) REFUSE(CUDA_ERROR_INVALID_DEVICE, "no device " + std::to_string(device));
  // Rule: each release must match an earlier retain.
  if (s.primary_refs[device] <= 0) REFUSE(CUDA_ERROR_INVALID_CONTEXT, "release without a matching retain");
  --s.primary_refs[device];
  return CUDA_SUCCESS;
}

CUresult fake_cuCtxGetCurrent(CUcontext* ctx) {
  ENTER("cuCtxGetCurrent");
  NEED_INIT;
  if (ctx == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null context pointer");
  *ctx = context_stack.empty() ? nullptr : context_stack.back();
  return CUDA_SUCCESS;
}

CUresult fake_cuCtxPushCurrent(CUcontext ctx) {
  ENTER("cuCtxPushCurrent");
  NEED_INIT;
  // Rule: only a live context can be made current.
  if (ctx == nullptr || ctx < &s.contexts[0] || ctx >= &s.contexts[kMaxDevices])
    REFUSE(CUDA_ERROR_INVALID_CONTEXT, "not a context handed out by this driver");
  if (s.primary_refs[ctx->device] <= 0) REFUSE(CUDA_ERROR_INVALID_CONTEXT, "pushing a released primary context");
  context_stack.push_back(ctx);
  return CUDA_SUCCESS;
}

CUresult fake_cuCtxPopCurrent(CUcontext* ctx) {
  ENTER("cuCtxPopCurrent");
  NEED_INIT;
  // Rule: popping needs a context on this thread's stack.
  if (context_stack.empty()) REFUSE(CUDA_ERROR_INVALID_CONTEXT, "pop with no current context");
  if (ctx) *ctx = context_stack.back();
  context_stack.pop_back();
  return CUDA_SUCCESS;
}

CUresult fake_cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                            CUmemAllocationGranularity_flags option) {
  ENTER("cuMemGetAllocationGranularity");
  NEED_INIT;
  // Some drivers want a current context for this query (FAKE_CUDA_GRANULARITY_NEEDS_CONTEXT); vpaged
  // retries with the primary context then. Reported as a plain error, not a violation.
  if (config(s).granularity_needs_context && context_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (granularity == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null granularity");
  if (!device_pinned_prop(s, prop)) REFUSE(CUDA_ERROR_INVALID_VALUE, "not pinned memory on a visible device");
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    REFUSE(CUDA_ERROR_INVALID_VALUE, "unknown granularity option");
  *granularity = config(s).granularity;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                          unsigned long long flags) {
  ENTER("cuMemCreate");
  NEED_CONTEXT;
  NO_CAPTURE;
  if (handle == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null handle");
  // Rule: size must be a positive multiple of the granularity; flags must be 0.
  if (size == 0 || size % config(s).granularity != 0)
    REFUSE(CUDA_ERROR_INVALID_VALUE, "size " + std::to_string(size) + " is not a multiple of the granularity");
  if (flags != 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (!device_pinned_prop(s, prop)) REFUSE(CUDA_ERROR_INVALID_VALUE, "not pinned memory on a visible device");
  // Rule: the handle types asked for must be ones the device supports (vpaged asks for POSIX file descriptors
  // only where CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED says so; the fake models no other).
  const bool shareable = prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE && !shareable)
    REFUSE(CUDA_ERROR_NOT_SUPPORTED, "handle types other than POSIX file descriptors are not modelled");
  if (shareable && !config(s).posix_fd)
    REFUSE(CUDA_ERROR_NOT_SUPPORTED, "POSIX file-descriptor handles asked of a device that does not support them");
  // The device's memory is finite (fake_cuda_set_memory_limit): CUDA_ERROR_OUT_OF_MEMORY past it.
  if (s.memory_limit >= 0 && s.bytes_allocated + size > static_cast<size_t>(s.memory_limit))
    return CUDA_ERROR_OUT_OF_MEMORY;
  const std::string name = "fake-cuda-allocation-d" + std::to_string(prop->location.id);
  int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *handle = s.next_handle++;
  s.allocations[*handle] = Allocation{fd, size, prop->location.id, shareable};
  s.bytes_allocated += size;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemRelease(CUmemGenericAllocationHandle handle) {
  ENTER("cuMemRelease");
  NEED_CONTEXT;
  NO_CAPTURE;
  auto it = s.allocations.find(handle);
  // Rule: the handle must come from cuMemCreate and not be released yet.
  if (it == s.allocations.end() || it->second.released)
    REFUSE(CUDA_ERROR_INVALID_VALUE, "unknown or already released handle");
  // The driver frees the memory once the handle is released and its last mapping is gone: while mappings
  // remain, the bytes stay allocated (fake_cuMemUnmap frees them with the last one).
  it->second.released = true;
  if (it->second.mappings == 0) {
    close(it->second.fd);
    if (!it->second.imported) s.bytes_allocated -= it->second.size;
    s.allocations.erase(it);
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                  unsigned long long flags) {
  ENTER("cuMemAddressReserve");
  NEED_CONTEXT;
  if (ptr == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null pointer");
  // Rules: size a positive multiple of the host page size; alignment 0 or a power of two; flags 0.
  // (vpaged passes no address hint, and the fake does not model hints.)
  const size_t host_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (size == 0 || size % host_page != 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "size is not a multiple of the host page");
  if (alignment & (alignment - 1)) REFUSE(CUDA_ERROR_INVALID_VALUE, "alignment is not a power of two");
  if (flags != 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (addr != 0) REFUSE(CUDA_ERROR_NOT_SUPPORTED, "address hints are not modelled by the fake");
  // A default alignment of the granularity, so that granularity-sized pages map anywhere inside.
  const size_t align = std::max<size_t>(alignment, config(s).granularity);
  void* raw = mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;  // address space exhausted
  const uintptr_t lo = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (lo + align - 1) / align * align;  // align need not be a power of two here
  if (start > lo) munmap(raw, start - lo);
  const uintptr_t end = lo + size + align;
  if (end > start + size) munmap(reinterpret_cast<void*>(start + size), end - (start + size));
  s.reservations[start] = size;
  *ptr = static_cast<CUdeviceptr>(start);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  ENTER("cuMemAddressFree");
  NEED_CONTEXT;
  // Rule: ptr and size must be exactly what cuMemAddressReserve returned and was given.
  auto it = s.reservations.find(ptr);
  if (it == s.reservations.end()) REFUSE(CUDA_ERROR_INVALID_VALUE, "not the start of a reservation");
  if (it->second != size) REFUSE(CUDA_ERROR_INVALID_VALUE, "size differs from the reservation's");
  // Rule: everything mapped inside must be unmapped first.
  auto m = s.mappings.lower_bound(ptr);
  if (m != s.mappings.end() && m->first < ptr + size)
    REFUSE(CUDA_ERROR_INVALID_VALUE, "the reservation still has mappings");
  munmap(reinterpret_cast<void*>(ptr), size);
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                       unsigned long long flags) {
  ENTER("cuMemMap");
  NEED_CONTEXT;
  NO_CAPTURE;
  auto a = s.allocations.find(handle);
  if (a == s.allocations.end() || a->second.released) REFUSE(CUDA_ERROR_INVALID_VALUE, "unknown or released handle");
  // Rules: offset must currently be 0 and flags 0; ptr a multiple of the granularity. The driver also
  // accepts a prefix of an allocation; vpaged always maps a whole page, so any other size is a bug.
  if (offset != 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "offset must be 0");
  if (flags != 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (ptr % config(s).granularity != 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "address not aligned to the granularity");
  // An imported allocation's size is not known to the importer (the descriptor does not carry it): one smaller
  // than the mapping is refused as the driver refuses it, not as a violation; a larger one maps its prefix, as
  // the driver allows. vpaged maps its own pages whole, so another size for them is a bug.
  if (a->second.imported && size > a->second.size) return CUDA_ERROR_INVALID_VALUE;
  if (a->second.imported ? size % config(s).granularity != 0 : size != a->second.size)
    REFUSE(CUDA_ERROR_INVALID_VALUE, "size differs from the allocation's");
  // Rule: the range must lie in one reservation and must not be mapped already.
  if (!inside_one_reservation(s, ptr, size)) REFUSE(CUDA_ERROR_INVALID_VALUE, "range outside a reservation");
  auto next = s.mappings.lower_bound(ptr);
  if (next != s.mappings.end() && next->first < ptr + size) REFUSE(CUDA_ERROR_INVALID_VALUE, "range already mapped");
  if (mapping_at(s, ptr) != s.mappings.end()) REFUSE(CUDA_ERROR_INVALID_VALUE, "range already mapped");
  // Rule: a new mapping is not accessible until cuMemSetAccess grants access.
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->second.fd, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  s.mappings[ptr] = Mapping{size, handle, false, false};
  ++a->second.mappings;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemUnmap(CUdeviceptr ptr, size_t size) {
  ENTER("cuMemUnmap");
  NEED_CONTEXT;
  NO_CAPTURE;
  // Rule: the range must consist of entire mappings (no sub-range of one).
  if (!whole_mappings(s, ptr, size)) REFUSE(CUDA_ERROR_INVALID_VALUE, "range is not a sequence of whole mappings");
  // Rule (the driver API reference): "the range must be the entire contiguous address range that was mapped
  // to", i.e. one mapping. A run of several is refused (CUDA_ERROR_INVALID_VALUE), unless the fake models a
  // driver that accepts it (FAKE_CUDA_MULTI_UNMAP=1). Not a violation: the caller may try the run first and
  // fall back to one call per mapping; counted so that checks can see the refusals.
  if (!config(s).multi_unmap && s.mappings.at(ptr).size != size) {
    ++s.refused_unmaps;
    return CUDA_ERROR_INVALID_VALUE;
  }
  // Work still queued on a stream (the legacy one included: its copies are asynchronous) that touches this
  // memory faults: vpaged must synchronize the stream before unmapping.
  fault_queued_work_in(s, ptr, size);
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                 -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_UNKNOWN;
  for (uintptr_t at = ptr; at < ptr + size;) {
    auto it = s.mappings.find(at);
    at += it->second.size;
    // A released handle's memory goes with its last mapping.
    auto a = s.allocations.find(it->second.handle);
    if (a != s.allocations.end() && --a->second.mappings == 0 && a->second.released) {
      close(a->second.fd);
      if (!a->second.imported) s.bytes_allocated -= a->second.size;
      s.allocations.erase(a);
    }
    s.mappings.erase(it);
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  ENTER("cuMemSetAccess");
  NEED_CONTEXT;
  NO_CAPTURE;
  // Rules: at least one descriptor, each naming a visible device and known access flags; the range
  // must be fully mapped (the fake requires whole mappings, which is how vpaged calls it).
  if (desc == nullptr || count == 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "no access descriptors");
  bool read_write = false;
  bool read_only = false;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(s, desc[i].location.id))
      REFUSE(CUDA_ERROR_INVALID_VALUE, "descriptor does not name a visible device");
    if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      REFUSE(CUDA_ERROR_INVALID_VALUE, "unknown access flags");
    read_write |= desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    read_only |= desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ;
  }
  if (!whole_mappings(s, ptr, size)) REFUSE(CUDA_ERROR_INVALID_VALUE, "range is not fully mapped");
  // Read-only access (imported pages) is PROT_READ: a write through it faults, as on the device.
  const int prot = read_write ? PROT_READ | PROT_WRITE : (read_only ? PROT_READ : PROT_NONE);
  if (mprotect(reinterpret_cast<void*>(ptr), size, prot) != 0) return CUDA_ERROR_UNKNOWN;
  for (uintptr_t at = ptr; at < ptr + size;) {
    Mapping& m = s.mappings.at(at);
    m.accessible = read_write || read_only;
    m.writable = read_write;
    at += m.size;
  }
  return CUDA_SUCCESS;
}

// Sharing an allocation between processes. Export: a POSIX file descriptor of the handle's memory (a dup of its
// memfd), owned by the caller. Import: the memory behind such a descriptor (received from another process) as a
// handle of this process; the caller keeps its descriptor. The imported handle is released and unmapped as any.
CUresult fake_cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                           CUmemAllocationHandleType type, unsigned long long flags) {
  ENTER("cuMemExportToShareableHandle");
  NEED_INIT;
  if (shareable == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null output");
  // Rules: a live handle; the type asked for must be one requested when the allocation was made; flags 0.
  auto a = s.allocations.find(handle);
  if (a == s.allocations.end() || a->second.released) REFUSE(CUDA_ERROR_INVALID_VALUE, "unknown or released handle");
  if (flags != 0) REFUSE(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) REFUSE(CUDA_ERROR_INVALID_VALUE, "only POSIX fds are modelled");
  if (!a->second.shareable && !a->second.imported)
    REFUSE(CUDA_ERROR_INVALID_VALUE, "the allocation was made without POSIX file-descriptor handles requested");
  const int fd = dup(a->second.fd);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(shareable) = fd;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os_handle,
                                             CUmemAllocationHandleType type) {
  ENTER("cuMemImportFromShareableHandle");
  NEED_CONTEXT;
  NO_CAPTURE;
  if (handle == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null handle");
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) REFUSE(CUDA_ERROR_INVALID_VALUE, "only POSIX fds are modelled");
  // For POSIX file descriptors the "OS handle" is the descriptor's value itself.
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(os_handle));
  // A descriptor that is not an exported allocation is refused, as the driver refuses it; not a violation: the
  // caller cannot tell such a descriptor from a good one before asking.
  char link[64];
  char target[PATH_MAX] = {};
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t len = readlink(link, target, sizeof target - 1);
  const std::string prefix = "/memfd:fake-cuda-allocation-d";
  if (len <= 0 || std::strncmp(target, prefix.c_str(), prefix.size()) != 0) return CUDA_ERROR_INVALID_VALUE;
  const int device = std::atoi(target + prefix.size());
  struct stat st{};
  if (fstat(fd, &st) != 0 || st.st_size <= 0) return CUDA_ERROR_INVALID_VALUE;
  const int own = dup(fd);
  if (own < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *handle = s.next_handle++;
  Allocation imported{own, static_cast<size_t>(st.st_size), device, false, true};
  s.allocations[*handle] = imported;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle handle) {
  ENTER("cuMemGetAllocationPropertiesFromHandle");
  NEED_INIT;
  if (prop == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null properties");
  auto a = s.allocations.find(handle);
  if (a == s.allocations.end() || a->second.released) REFUSE(CUDA_ERROR_INVALID_VALUE, "unknown or released handle");
  *prop = CUmemAllocationProp{};
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = a->second.device;
  if (a->second.shareable) prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return CUDA_SUCCESS;
}

// Copies: the device side must be mapped and accessible (the driver reports an invalid or illegal
// address otherwise); the stream must be one the fake knows. The copy is queued on the stream (the legacy
// one too) and done when that stream is synchronized.
CUresult fake_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  ENTER("cuMemcpyDtoDAsync");
  NEED_CONTEXT;
  if (!known_stream(s, stream)) REFUSE(CUDA_ERROR_INVALID_HANDLE, "unknown stream");
  if (!accessible(s, dst, bytes, true) || !accessible(s, src, bytes))
    REFUSE(CUDA_ERROR_INVALID_VALUE, "device range not mapped with access (write access for the destination)");
  return submit_copy(s, stream, PendingOp{PendingOp::kDtoD, dst, src, bytes});
}

CUresult fake_cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  ENTER("cuMemcpyDtoHAsync");
  NEED_CONTEXT;
  if (!known_stream(s, stream)) REFUSE(CUDA_ERROR_INVALID_HANDLE, "unknown stream");
  if (dst == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null host pointer");
  if (!accessible(s, src, bytes)) REFUSE(CUDA_ERROR_INVALID_VALUE, "device range not mapped with access");
  return submit_copy(s, stream, PendingOp{PendingOp::kDtoH, reinterpret_cast<uintptr_t>(dst), src, bytes});
}

CUresult fake_cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  ENTER("cuMemcpyHtoDAsync");
  NEED_CONTEXT;
  if (!known_stream(s, stream)) REFUSE(CUDA_ERROR_INVALID_HANDLE, "unknown stream");
  if (src == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null host pointer");
  if (!accessible(s, dst, bytes, true)) REFUSE(CUDA_ERROR_INVALID_VALUE, "device range not mapped with write access");
  return submit_copy(s, stream, PendingOp{PendingOp::kHtoD, dst, reinterpret_cast<uintptr_t>(src), bytes});
}

CUresult fake_cuStreamSynchronize(CUstream stream) {
  ENTER("cuStreamSynchronize");
  NEED_CONTEXT;
  if (!known_stream(s, stream)) REFUSE(CUDA_ERROR_INVALID_HANDLE, "unknown stream");
  if (legacy_stream(stream)) {
    // In the global capture mode the legacy stream may not be waited for while any capture runs: the call
    // fails and breaks the capture (not a violation, as below).
    if (global_capture_running(s)) {
      for (auto& [handle, st] : s.streams)
        if (st->capturing && st->mode == kCaptureGlobal) st->invalidated = true;
      return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    FakeStream& legacy = stream_of(s, stream);
    drain(s, legacy);
    return s.sticky[legacy.device];
  }
  // Waits for this stream only: the tests' streams are non-blocking, as torch's are.
  FakeStream& st = *s.streams.at(stream);
  if (st.device != context_stack.back()->device)
    REFUSE(CUDA_ERROR_INVALID_HANDLE, "stream of another device's context");
  // A capturing stream cannot be waited for: the call fails and breaks the capture (not a violation: the
  // caller may not know the stream captures, and the driver's answer is the documented one).
  if (st.capturing) {
    st.invalidated = true;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  drain(s, st);
  return s.sticky[st.device];
}

CUresult fake_cuCtxSynchronize() {
  ENTER("cuCtxSynchronize");
  NEED_CONTEXT;
  // While a stream of the context captures a graph, waiting for the device is not permitted: the driver
  // returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and, in the global capture mode torch.cuda.graph uses by
  // default, invalidates the capture. Not a violation: see cuStreamSynchronize.
  const int device = context_stack.back()->device;
  bool capture = false;
  for (auto& [handle, st] : s.streams) {
    if (st->device != device || !st->capturing) continue;
    st->invalidated = true;
    capture = true;
  }
  if (capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  // Otherwise it waits for every stream of the context: the legacy one and the tests'.
  drain(s, s.legacy[device]);
  for (auto& [handle, st] : s.streams)
    if (st->device == device && s.sticky[device] == CUDA_SUCCESS) drain(s, *st);
  return s.sticky[device];
}

CUresult fake_cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  ENTER("cuStreamIsCapturing");
  NEED_CONTEXT;
  if (status == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null status");
  if (!known_stream(s, stream)) REFUSE(CUDA_ERROR_INVALID_HANDLE, "unknown stream");
  // The legacy stream never captures itself, but while a capture runs in the global mode it may not be used
  // (a wait on it would break the capture): the driver answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT then.
  if (legacy_stream(stream)) {
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return global_capture_running(s) ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
  }
  const FakeStream& st = *s.streams.at(stream);
  if (st.device != context_stack.back()->device)
    REFUSE(CUDA_ERROR_INVALID_HANDLE, "stream of another device's context");
  *status = !st.capturing    ? CU_STREAM_CAPTURE_STATUS_NONE
            : st.invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                             : CU_STREAM_CAPTURE_STATUS_ACTIVE;
  return CUDA_SUCCESS;
}

// The entry points cuGetProcAddress hands out, with the CUDA version that introduced the signature
// the fake implements (the _v2 variants that cuda.h maps the plain names to).
struct EntryPoint {
  const char* name;
  void* fn;
  int since;
};

#define ENTRY(name, since) {#name, reinterpret_cast<void*>(&fake_##name), since}
const EntryPoint kEntryPoints[] = {
    ENTRY(cuGetErrorName, 6000),
    ENTRY(cuGetErrorString, 6000),
    ENTRY(cuInit, 2000),
    ENTRY(cuDeviceGetCount, 2000),
    ENTRY(cuDeviceGet, 2000),
    ENTRY(cuDeviceGetAttribute, 2000),
    ENTRY(cuDevicePrimaryCtxRetain, 7000),
    ENTRY(cuDevicePrimaryCtxRelease, 11000),
    ENTRY(cuCtxGetCurrent, 4000),
    ENTRY(cuCtxPushCurrent, 4000),
    ENTRY(cuCtxPopCurrent, 4000),
    ENTRY(cuMemGetAllocationGranularity, 10020),
    ENTRY(cuMemCreate, 10020),
    ENTRY(cuMemRelease, 10020),
    ENTRY(cuMemAddressReserve, 10020),
    ENTRY(cuMemAddressFree, 10020),
    ENTRY(cuMemMap, 10020),
    ENTRY(cuMemUnmap, 10020),
    ENTRY(cuMemSetAccess, 10020),
    ENTRY(cuMemcpyDtoDAsync, 3020),
    ENTRY(cuMemcpyDtoHAsync, 3020),
    ENTRY(cuMemcpyHtoDAsync, 3020),
    ENTRY(cuStreamSynchronize, 2000),
    ENTRY(cuCtxSynchronize, 2000),
    ENTRY(cuStreamIsCapturing, 10000),
    ENTRY(cuMemExportToShareableHandle, 10020),
    ENTRY(cuMemImportFromShareableHandle, 10020),
    ENTRY(cuMemGetAllocationPropertiesFromHandle, 10020),
};
#undef ENTRY

}  // namespace

// The one symbol vpaged takes with dlsym. Documented behaviour: a cudaVersion above the driver's is
// CUDA_ERROR_INVALID_VALUE; an unknown symbol, or one with no ABI-compatible variant at cudaVersion,
// is CUDA_SUCCESS with *pfn = NULL and the reason in *symbolStatus.
FAKE_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult* symbolStatus) {
  ENTER("cuGetProcAddress");
  if (symbol == nullptr || pfn == nullptr) REFUSE(CUDA_ERROR_INVALID_VALUE, "null symbol or pfn");
  *pfn = nullptr;
  if (flags != CU_GET_PROC_ADDRESS_DEFAULT && flags != CU_GET_PROC_ADDRESS_LEGACY_STREAM &&
      flags != CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
    REFUSE(CUDA_ERROR_INVALID_VALUE, "unknown flags");
  s.last_proc_flags = flags;
  s.last_proc_version = cudaVersion;
  if (cudaVersion > config(s).driver_version) return CUDA_ERROR_INVALID_VALUE;  // a newer API than the driver's
  for (const EntryPoint& e : kEntryPoints) {
    if (std::strcmp(e.name, symbol) != 0 || config(s).missing.count(symbol)) continue;
    if (cudaVersion < e.since) {
      if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return CUDA_SUCCESS;
    }
    *pfn = e.fn;
    if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
  }
  if (symbolStatus) *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_SUCCESS;
}

// --------------------------------------------------------------------------------------------------
// Test hooks (tests/test_cuda_backend_fake.py calls them through ctypes).

// How many times an entry point was called (by its plain name, "cuMemMap"), injected failures included.
FAKE_EXPORT long fake_cuda_calls(const char* name) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.calls.find(name);
  return it == s.calls.end() ? 0 : it->second;
}

// Live driver objects: "allocations", "mappings", "accessible_mappings", "reservations",
// "allocated_bytes", "primary_refs" (all devices), "context_depth" (the calling thread's stack).
FAKE_EXPORT long long fake_cuda_live(const char* what) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::string w = what;
  if (w == "allocations") return static_cast<long long>(s.allocations.size());
  if (w == "mappings") return static_cast<long long>(s.mappings.size());
  if (w == "accessible_mappings") {
    long long n = 0;
    for (auto& [start, m] : s.mappings) n += m.accessible;
    return n;
  }
  if (w == "reservations") return static_cast<long long>(s.reservations.size());
  if (w == "allocated_bytes") return static_cast<long long>(s.bytes_allocated);
  if (w == "primary_refs") {
    long long n = 0;
    for (int r : s.primary_refs) n += r;
    return n;
  }
  if (w == "context_depth") return static_cast<long long>(context_stack.size());
  if (w == "refused_unmaps") return s.refused_unmaps;
  if (w == "released_mapped") {  // released handles whose memory a mapping still holds
    long long n = 0;
    for (auto& [h, a] : s.allocations) n += a.released;
    return n;
  }
  return -1;
}

// Make a later call of entry point `name` fail: `skip` calls still succeed, the next returns `result`.
FAKE_EXPORT void fake_cuda_fail(const char* name, long skip, int result) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.failures[name] = InjectedFailure{skip, static_cast<CUresult>(result)};
}

FAKE_EXPORT void fake_cuda_clear_failures() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.failures.clear();
}

// Bytes of allocations the device can hold (< 0: unlimited); cuMemCreate past it is out of memory.
FAKE_EXPORT void fake_cuda_set_memory_limit(long long bytes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.memory_limit = bytes;
}

// A stream of `device`, as torch.cuda.Stream() would make (non-blocking). The handle is what vpaged's
// calls take as a stream (an integer on the Python side).
FAKE_EXPORT CUstream fake_cuda_stream_create(int device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto* st = new FakeStream;
  st->device = device;
  CUstream handle = reinterpret_cast<CUstream>(st);
  s.streams[handle] = st;
  return handle;
}

// Queue a "kernel" on `stream` that reads [ptr, ptr + bytes): it runs when the stream is synchronized,
// and faults (sticky) if the range is unmapped before then. Returns the context's sticky error, if any.
FAKE_EXPORT int fake_cuda_launch_read(CUstream stream, CUdeviceptr ptr, size_t bytes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  FakeStream& st = *s.streams.at(stream);
  if (s.sticky[st.device] != CUDA_SUCCESS) return s.sticky[st.device];
  if (!accessible(s, ptr, bytes)) {
    fault(s, st, "a kernel was launched on a device range that is not mapped");
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  st.queue.push_back(PendingOp{PendingOp::kRead, 0, ptr, bytes});
  return CUDA_SUCCESS;
}

// Start capturing a graph on a test stream (as cudaStreamBeginCapture would) in a capture mode (0 global, as
// torch.cuda.graph by default; 1 thread-local; 2 relaxed), from the calling thread: 0, or
// CUDA_ERROR_INVALID_HANDLE for the legacy stream, CUDA_ERROR_ILLEGAL_STATE when it captures already.
FAKE_EXPORT int fake_cuda_begin_capture_mode(CUstream stream, int mode) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (legacy_stream(stream) || !s.streams.count(stream)) return CUDA_ERROR_INVALID_HANDLE;
  if (mode < kCaptureGlobal || mode > kCaptureRelaxed) return CUDA_ERROR_INVALID_VALUE;
  FakeStream& st = *s.streams.at(stream);
  if (st.capturing) return CUDA_ERROR_ILLEGAL_STATE;
  st.capturing = true;
  st.invalidated = false;
  st.mode = mode;
  st.capture_thread = std::this_thread::get_id();
  return CUDA_SUCCESS;
}

FAKE_EXPORT int fake_cuda_begin_capture(CUstream stream) {
  return fake_cuda_begin_capture_mode(stream, kCaptureGlobal);
}

// End the capture: 0 when the graph was captured, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED when a call during
// the capture broke it, CUDA_ERROR_ILLEGAL_STATE when the stream was not capturing.
FAKE_EXPORT int fake_cuda_end_capture(CUstream stream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (legacy_stream(stream) || !s.streams.count(stream)) return CUDA_ERROR_INVALID_HANDLE;
  FakeStream& st = *s.streams.at(stream);
  if (!st.capturing) return CUDA_ERROR_ILLEGAL_STATE;
  st.capturing = false;
  return st.invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}

// Work still queued on a stream (copies and kernels; the legacy stream: device 0's, or the current device's).
FAKE_EXPORT long fake_cuda_pending(CUstream stream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<long>(stream_of(s, stream).queue.size());
}

// Synchronize a stream as torch's stream.synchronize() would (without a current context on the thread).
FAKE_EXPORT int fake_cuda_stream_synchronize(CUstream stream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  FakeStream& st = stream_of(s, stream);
  drain(s, st);
  return s.sticky[st.device];
}

// A context's sticky error (0: none). Clearing it stands in for restarting the process, so that a check
// that provoked one on purpose can tear down cleanly.
FAKE_EXPORT int fake_cuda_sticky_error(int device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.sticky[device];
}

FAKE_EXPORT void fake_cuda_clear_sticky_error(int device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.sticky[device] = CUDA_SUCCESS;
}

// Forget violations provoked on purpose (a check that shows the fake catches a bug).
FAKE_EXPORT void fake_cuda_clear_violations() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.violations = 0;
  s.last_violation.clear();
}

FAKE_EXPORT long fake_cuda_violations() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.violations;
}

// The last violation as "entry point: rule" ("" when none). Copied into `out` (size bytes).
FAKE_EXPORT void fake_cuda_last_violation(char* out, size_t size) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (size == 0) return;
  std::strncpy(out, s.last_violation.c_str(), size - 1);
  out[size - 1] = '\0';
}

// Flags and CUDA version of the last cuGetProcAddress request (~0 / -1 before any).
FAKE_EXPORT unsigned long long fake_cuda_proc_flags() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.last_proc_flags;
}

FAKE_EXPORT int fake_cuda_proc_version() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.last_proc_version;
}

// Stand in for another library (torch) that keeps a device's primary context current on this thread:
// retain it and push it. Returns 0 on success. fake_cuda_pop_primary undoes it. These go through the
// entry points, so they count as calls of cuInit, cuDevicePrimaryCtxRetain, cuCtxPushCurrent, ...
FAKE_EXPORT int fake_cuda_push_primary(int device) {
  CUcontext ctx = nullptr;
  if (fake_cuInit(0) != CUDA_SUCCESS) return 1;
  if (fake_cuDevicePrimaryCtxRetain(&ctx, device) != CUDA_SUCCESS) return 2;
  return fake_cuCtxPushCurrent(ctx) == CUDA_SUCCESS ? 0 : 3;
}

FAKE_EXPORT int fake_cuda_pop_primary() {
  CUcontext ctx = nullptr;
  if (fake_cuCtxPopCurrent(&ctx) != CUDA_SUCCESS) return 1;
  return fake_cuDevicePrimaryCtxRelease(ctx->device) == CUDA_SUCCESS ? 0 : 2;
}

// Device of the calling thread's current context, -1 when none is current.
FAKE_EXPORT int fake_cuda_current_device() {
  return context_stack.empty() || context_stack.back() == nullptr ? -1 : context_stack.back()->device;
}
