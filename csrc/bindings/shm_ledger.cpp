// LedgerMapping: the shared mapping of a budget ledger (vpaged/memory/budget/segment.py), read and written only
// through bounds-checked copies and 64-bit atomics, with a SIGBUS guard against truncation.
//
// Why this is C++. The ledger has no lock: its control word moves only by compare-and-swap, and Python has no
// atomic operation on shared memory. Why the guard: whoever may write the segment's file may also truncate it,
// and a load or store past the file's new end raises SIGBUS, whose default action kills the process (every
// member at once). The handler maps anonymous zero pages over the faulting page when the address lies inside a
// registered ledger mapping and marks that mapping damaged; the access then completes on zeros (failing the
// checksums) and the Python side raises BudgetCorruptError. Wayland compositors guard their clients' shared
// buffers the same way. A fault anywhere else goes to the handler installed before this one (pytest's
// faulthandler, say), or, when there was none, kills the process as it would have.
#include <pybind11/pybind11.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

constexpr int kMaxRanges = 256;

struct GuardedRange {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<int> damaged{0};
};

GuardedRange g_ranges[kMaxRanges];
struct sigaction g_previous;  // the handler found when ours went in; faults outside our ranges go there
uintptr_t g_page_size = 4096;

void on_sigbus(int sig, siginfo_t* info, void* context);

void chain(int sig, siginfo_t* info, void* context) {
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // No handler before ours: the default action. A fault re-executes the instruction and dies of it; a SIGBUS
  // sent by kill() is re-raised, blocked until this handler returns.
  struct sigaction dfl{};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  if (info == nullptr || info->si_code <= 0) raise(sig);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (info != nullptr && info->si_code > 0) {  // raised by the kernel for an access, not sent by a process
    const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
    for (auto& r : g_ranges) {
      const uintptr_t b = r.begin.load(std::memory_order_acquire);
      if (b == 0 || addr < b || addr >= r.end.load(std::memory_order_acquire)) continue;
      void* page = reinterpret_cast<void*>(addr & ~(g_page_size - 1));
      // mmap is a plain system call here (no allocation, no lock): safe in a handler in practice.
      if (mmap(page, g_page_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) !=
          MAP_FAILED) {
        r.damaged.store(1, std::memory_order_release);
        return;
      }
      break;
    }
  }
  chain(sig, info, context);
}

// Installs the handler unless it is the current one. Called at every new mapping, so a handler installed after
// ours (faulthandler.enable() at a test run's start) is chained to rather than left in front.
void install_guard() {
  struct sigaction current{};
  sigaction(SIGBUS, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return;
  g_page_size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  struct sigaction ours{};
  ours.sa_sigaction = on_sigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  g_previous = current;
  sigaction(SIGBUS, &ours, nullptr);
}

class LedgerMapping {
 public:
  LedgerMapping(int fd, size_t size) : size_(size) {
    if (size == 0 || size % 8 != 0) throw std::invalid_argument("a ledger mapping's size is a positive multiple of 8");
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw std::runtime_error(std::string("mmap of the budget ledger failed: ") + strerror(errno));
    base_ = static_cast<char*>(p);
    install_guard();
    for (int i = 0; i < kMaxRanges; ++i) {
      uintptr_t expected = 0;
      // end first, then begin: the handler reads begin and only then end.
      if (g_ranges[i].begin.load() != 0) continue;
      g_ranges[i].end.store(reinterpret_cast<uintptr_t>(base_) + size_, std::memory_order_release);
      g_ranges[i].damaged.store(0);
      if (g_ranges[i].begin.compare_exchange_strong(expected, reinterpret_cast<uintptr_t>(base_))) {
        slot_ = i;
        break;
      }
    }
    if (slot_ < 0) {
      munmap(base_, size_);
      throw std::runtime_error("too many budget ledgers mapped in this process (256)");
    }
  }
  ~LedgerMapping() { close(); }

  void close() {
    if (base_ == nullptr) return;
    g_ranges[slot_].begin.store(0, std::memory_order_release);
    munmap(base_, size_);
    base_ = nullptr;
  }

  size_t size() const { return size_; }
  bool closed() const { return base_ == nullptr; }
  // Whether an access faulted (the file was truncated under the mapping): the zeros read since mean nothing.
  bool damaged() const { return base_ != nullptr && g_ranges[slot_].damaged.load(std::memory_order_acquire) != 0; }

  py::bytes read(size_t offset, size_t n) const {
    check(offset, n, 1);
    return py::bytes(base_ + offset, n);
  }
  void write(size_t offset, py::bytes data) {
    char* src = nullptr;
    Py_ssize_t n = 0;
    PyBytes_AsStringAndSize(data.ptr(), &src, &n);
    check(offset, static_cast<size_t>(n), 1);
    std::memcpy(base_ + offset, src, static_cast<size_t>(n));
  }
  uint64_t load64(size_t offset) const { return __atomic_load_n(word(offset), __ATOMIC_SEQ_CST); }
  void store64(size_t offset, uint64_t value) { __atomic_store_n(word(offset), value, __ATOMIC_SEQ_CST); }
  // Sets the word to `desired` if it holds `expected`; returns whether it did. Full barrier: the bytes written
  // before it (a table buffer) are visible to whoever sees the new word.
  bool cas64(size_t offset, uint64_t expected, uint64_t desired) {
    return __atomic_compare_exchange_n(word(offset), &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  }

 private:
  void check(size_t offset, size_t n, size_t align) const {
    if (base_ == nullptr) throw std::runtime_error("the budget ledger's mapping is closed");
    if (offset > size_ || n > size_ - offset || offset % align != 0)
      throw py::index_error("ledger access out of bounds: offset " + std::to_string(offset) + ", " + std::to_string(n) +
                            " bytes, mapping of " + std::to_string(size_));
  }
  uint64_t* word(size_t offset) const {
    check(offset, 8, 8);
    return reinterpret_cast<uint64_t*>(base_ + offset);
  }

  char* base_ = nullptr;
  size_t size_ = 0;
  int slot_ = -1;
};

}  // namespace

void register_shm_ledger(py::module_& m) {
  py::class_<LedgerMapping>(m, "LedgerMapping")
      .def(py::init<int, size_t>(), py::arg("fd"), py::arg("size"))
      .def("close", &LedgerMapping::close)
      .def_property_readonly("size", &LedgerMapping::size)
      .def_property_readonly("closed", &LedgerMapping::closed)
      .def_property_readonly("damaged", &LedgerMapping::damaged)
      .def("read", &LedgerMapping::read, py::arg("offset"), py::arg("n"))
      .def("write", &LedgerMapping::write, py::arg("offset"), py::arg("data"))
      .def("load64", &LedgerMapping::load64, py::arg("offset"))
      .def("store64", &LedgerMapping::store64, py::arg("offset"), py::arg("value"))
      .def("cas64", &LedgerMapping::cas64, py::arg("offset"), py::arg("expected"), py::arg("desired"));
}
