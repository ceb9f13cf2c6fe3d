// LedgerMapping: the shared mapping of a budget ledger (vpaged/memory/budget/segment.py), read and written only
// through bounds-checked copies and 64-bit atomics, under the fault guard (core/fault_guard.h) against truncation.
//
// Why this is C++. The ledger has no lock: its control word moves only by compare-and-swap, and Python has no
// atomic operation on shared memory. Why the guard: whoever may write the segment's file may also truncate it,
// and a load or store past the file's new end raises SIGBUS, whose default action kills the process (every
// member at once). Under the guard the access completes on zeros (failing the checksums), the mapping reads as
// damaged, and the Python side raises BudgetCorruptError.
#include <pybind11/pybind11.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/fault_guard.h"

namespace py = pybind11;

namespace {

class LedgerMapping {
 public:
  LedgerMapping(int fd, size_t size) : size_(size) {
    if (size == 0 || size % 8 != 0) throw std::invalid_argument("a ledger mapping's size is a positive multiple of 8");
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw std::runtime_error(std::string("mmap of the budget ledger failed: ") + strerror(errno));
    base_ = static_cast<char*>(p);
    slot_ = vpaged::guard_span(reinterpret_cast<uintptr_t>(base_), reinterpret_cast<uintptr_t>(base_) + size_);
    if (slot_ < 0) {
      munmap(base_, size_);
      base_ = nullptr;
      throw std::runtime_error("too many guarded mappings in this process (" +
                               std::to_string(vpaged::kMaxGuardedSpans) + ")");
    }
  }
  ~LedgerMapping() { close(); }

  void close() {
    if (base_ == nullptr) return;
    vpaged::unguard_span(slot_);
    munmap(base_, size_);
    base_ = nullptr;
  }

  size_t size() const { return size_; }
  bool closed() const { return base_ == nullptr; }
  // Whether an access faulted (the file was truncated under the mapping): the zeros read since mean nothing.
  bool damaged() const { return base_ != nullptr && vpaged::span_faults(slot_) != 0; }

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
