// Python bindings of the torch allocator hook: PoolAllocator, its per-device binding for the C entry
// points, and whole-allocation tensors (vpaged.empty) as DLPack capsules.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "core/dlpack.h"
#include "torch_allocator/torch_allocator.h"

namespace py = pybind11;
using namespace vpaged;

namespace {

// One allocation seen as a 1-D uint8 tensor; the allocation is freed when torch drops the tensor.
struct AllocationTensor {
  std::shared_ptr<PoolAllocator> allocator;
  void* ptr = nullptr;
  size_t size = 0;
  int64_t shape[1] = {0};
  int64_t strides[1] = {1};
  DLManagedTensor managed{};
};

void delete_allocation_tensor(DLManagedTensor* self) {
  auto* t = static_cast<AllocationTensor*>(self->manager_ctx);
  try {
    t->allocator->deallocate(t->ptr, t->size);
  } catch (...) {
    // A deleter cannot report; the allocator counted the failure (stats().bad_frees) and kept the pages.
  }
  delete t;
}

void capsule_destructor(PyObject* capsule) {
  // A capsule torch consumed is renamed "used_dltensor" and owned by torch from then on.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (m && m->deleter) m->deleter(m);
  } else {
    PyErr_Clear();
  }
}

py::capsule allocation_tensor(const std::shared_ptr<PoolAllocator>& allocator, size_t nbytes) {
  auto t = std::make_unique<AllocationTensor>();
  {
    py::gil_scoped_release unlocked;
    t->ptr = allocator->allocate(nbytes);  // throws with nothing allocated
  }
  t->allocator = allocator;
  t->size = nbytes;
  t->shape[0] = static_cast<int64_t>(nbytes);
  DLTensor& d = t->managed.dl_tensor;
  Backend& backend = allocator->pool()->backend();
  d.data = t->ptr;
  d.device.device_type = backend.dlpack_device_type();
  d.device.device_id = backend.device_index();
  d.ndim = 1;
  d.dtype = DLDataType{kDLUInt, 8, 1};
  d.shape = t->shape;
  d.strides = t->strides;
  d.byte_offset = 0;
  t->managed.manager_ctx = t.get();
  t->managed.deleter = delete_allocation_tensor;
  return py::capsule(&t.release()->managed, "dltensor", &capsule_destructor);
}

}  // namespace

void register_torch_allocator(py::module_& m) {
  py::class_<AllocatorStats>(m, "AllocatorStats")
      .def_readonly("page_size", &AllocatorStats::page_size)
      .def_readonly("segments", &AllocatorStats::segments)
      .def_readonly("bytes", &AllocatorStats::bytes)
      .def_readonly("mapped_bytes", &AllocatorStats::mapped_bytes)
      .def_readonly("peak_bytes", &AllocatorStats::peak_bytes)
      .def_readonly("mallocs", &AllocatorStats::mallocs)
      .def_readonly("frees", &AllocatorStats::frees)
      .def_readonly("failures", &AllocatorStats::failures)
      .def_readonly("bad_frees", &AllocatorStats::bad_frees)
      .def_readonly("max_bytes", &AllocatorStats::max_bytes)
      .def_readonly("deferred_frees", &AllocatorStats::deferred_frees);

  py::class_<PoolAllocator, std::shared_ptr<PoolAllocator>>(m, "PoolAllocator")
      .def(py::init<std::shared_ptr<PagePool>, size_t>(), py::arg("pool"), py::arg("max_bytes") = 0)
      .def(
          "allocate",
          [](PoolAllocator& a, size_t size, uintptr_t stream) {
            return reinterpret_cast<uintptr_t>(a.allocate(size, stream));
          },
          py::arg("size"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "free",
          [](PoolAllocator& a, uintptr_t ptr, size_t size, uintptr_t stream) {
            a.deallocate(reinterpret_cast<void*>(ptr), size, stream);
          },
          py::arg("ptr"), py::arg("size") = 0, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("flush", &PoolAllocator::flush_deferred, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
           "Complete the frees deferred during a CUDA graph capture where no capture is known to run; returns "
           "how many are still deferred.")
      .def("owns", [](const PoolAllocator& a, uintptr_t ptr) { return a.owns(reinterpret_cast<void*>(ptr)); })
      .def("contains", [](const PoolAllocator& a, uintptr_t ptr) { return a.contains(reinterpret_cast<void*>(ptr)); })
      .def(
          "stats",
          [](PoolAllocator& a) {
            a.flush_deferred();  // as vpaged_torch_stats: completed frees show as frees
            return a.stats();
          },
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("live_segments", &PoolAllocator::live_segments)
      .def_property_readonly("max_bytes", &PoolAllocator::max_bytes)
      .def("tensor", &allocation_tensor, py::arg("nbytes"),
           "A DLPack capsule of a 1-D uint8 tensor over a new allocation, freed when the tensor dies.");

  m.def("bind_device_allocator", &bind_device_allocator, py::arg("device"), py::arg("allocator"));
  m.def(
      "unbind_device_allocator",
      [](int device, const std::shared_ptr<PoolAllocator>& a) { unbind_device_allocator(device, a.get()); },
      py::arg("device"), py::arg("allocator"));
  m.def("device_allocator", &device_allocator, py::arg("device"));
}
