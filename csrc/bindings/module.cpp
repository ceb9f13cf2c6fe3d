// Python bindings of the core: backends, PagePool, VirtualRange. Tensors leave as DLPack capsules.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/backend.h"
#include "core/dlpack.h"
#include "core/errors.h"
#include "core/page_pool.h"
#include "core/virtual_range.h"

namespace py = pybind11;

using namespace vpaged;

void register_kernels(py::module_& m);          // csrc/bindings/kernels.cpp
void register_torch_allocator(py::module_& m);  // csrc/bindings/torch_allocator.cpp
void register_shm_ledger(py::module_& m);       // csrc/bindings/shm_ledger.cpp

namespace {

void raise_as(const char* name, const char* what) {
  py::object cls = py::module_::import("vpaged.errors").attr(name);
  PyErr_SetString(cls.ptr(), what);
}

void capsule_destructor(PyObject* capsule) {
  // A capsule that torch consumed is renamed "used_dltensor" and owned by torch from then on.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (m && m->deleter) m->deleter(m);
  } else {
    PyErr_Clear();
  }
}

// Page index lists arrive on every map and unmap: a list of Python ints is read directly. pybind11's generic
// conversion walks it through the iterator protocol and type-checks each element, which showed in profiles of
// map + unmap. Anything else (a tuple, numpy integers, a bad element) takes the generic conversion and its
// TypeError.
std::vector<int64_t> index_list(py::handle obj) {
  PyObject* o = obj.ptr();
  if (PyList_CheckExact(o)) {
    const Py_ssize_t n = PyList_GET_SIZE(o);
    std::vector<int64_t> out(static_cast<size_t>(n));
    Py_ssize_t i = 0;
    for (; i < n; ++i) {
      PyObject* item = PyList_GET_ITEM(o, i);
      int overflow = 0;
      if (!PyLong_CheckExact(item)) break;
      out[static_cast<size_t>(i)] = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (overflow != 0) break;
    }
    if (i == n) return out;
  }
  try {
    return obj.cast<std::vector<int64_t>>();
  } catch (const py::cast_error&) {
    throw py::type_error("expected a list of ints, got " + std::string(py::str(py::type::handle_of(obj))));
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "vpaged core: backends, page pool, virtual ranges";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfPages& e) {
      raise_as("OutOfPagesError", e.what());
    } catch (const AddressSpace& e) {
      raise_as("AddressSpaceError", e.what());
    } catch (const MappingLimit& e) {
      raise_as("MappingLimitError", e.what());
    } catch (const BackendUnavailable& e) {
      raise_as("BackendUnavailableError", e.what());
    } catch (const BackendFailure& e) {
      raise_as("BackendError", e.what());
    } catch (const ViewsAlive& e) {
      raise_as("ViewsAliveError", e.what());
    } catch (const InvalidArgument& e) {
      raise_as("InvalidArgumentError", e.what());
    }
  });

  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("device", &Backend::device)
      .def_property_readonly("page_size", &Backend::page_size)
      .def_property_readonly("capacity_pages", &Backend::capacity_pages)
      .def_property_readonly("created_pages", &Backend::created_pages)
      .def_property_readonly("map_calls", &Backend::map_calls)
      .def_property_readonly("unmap_calls", &Backend::unmap_calls)
      .def_property_readonly("unmap_fallbacks", &Backend::unmap_fallbacks)
      .def_property_readonly("addressable", &Backend::addressable)
      .def_property_readonly("page_ids", &Backend::page_ids)
      .def_property_readonly("can_attach_file_pages", &Backend::can_attach_file_pages)
      .def_property_readonly("file_page_faults", &Backend::file_page_faults)
      .def_property_readonly("can_share_pages", &Backend::can_share_pages)
      .def("home_page", &Backend::home_page, py::arg("va"))
      .def("reserve", &Backend::reserve, py::arg("bytes"))
      .def("release", &Backend::release, py::arg("va"), py::arg("bytes"))
      .def("synchronize", &Backend::synchronize, py::arg("stream") = 0);

  m.def("host_backend", &make_host_backend, py::arg("page_size"), py::arg("capacity_pages"));
  m.def("accounting_backend", &make_accounting_backend, py::arg("page_size"), py::arg("capacity_pages"));
  m.def("cuda_backend", &make_cuda_backend, py::arg("device"), py::arg("page_size"), py::arg("capacity_pages"),
        py::arg("reserve_pages") = 0);
  m.def("cuda_unavailable_reason", &cuda_unavailable_reason, py::arg("device") = 0);
  m.def("cuda_granularity", &cuda_granularity, py::arg("device") = 0);
  m.def("cuda_primary_context_held", &cuda_primary_context_held, py::arg("device") = 0);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("built_with_cuda", &built_with_cuda);

  py::class_<PoolStats>(m, "PoolStats")
      .def_readonly("page_size", &PoolStats::page_size)
      .def_readonly("total_pages", &PoolStats::total_pages)
      .def_readonly("used_pages", &PoolStats::used_pages)
      .def_readonly("free_pages", &PoolStats::free_pages)
      .def_readonly("high_water_pages", &PoolStats::high_water_pages)
      .def_readonly("created_pages", &PoolStats::created_pages)
      .def_readonly("kv_pages", &PoolStats::kv_pages)
      .def_readonly("allocator_pages", &PoolStats::allocator_pages)
      .def_readonly("kept_free_pages", &PoolStats::kept_free_pages)
      .def_readonly("unmap_fallbacks", &PoolStats::unmap_fallbacks)
      .def_readonly("release_pending", &PoolStats::release_pending)
      .def_readonly("deferred_teardowns", &PoolStats::deferred_teardowns)
      .def_readonly("file_pages", &PoolStats::file_pages)
      .def_readonly("imported_pages", &PoolStats::imported_pages);

  // The process-wide CUDA graph capture flag (page_pool.h): vpaged.memory.capture raises it around a capture.
  m.def("begin_capture", &PagePool::begin_capture);
  m.def("end_capture", &PagePool::end_capture,
        "Lower the capture flag; the last one releases what every pool deferred during the capture");
  m.def("capture_flagged", &PagePool::capture_flagged);

  py::class_<PagePool, std::shared_ptr<PagePool>>(m, "PagePool")
      .def(py::init<std::shared_ptr<Backend>, size_t, size_t>(), py::arg("backend"), py::arg("reserve_pages") = 0,
           py::arg("create_batch") = 64)
      .def_property_readonly("backend", &PagePool::backend_ptr)
      .def_property_readonly("page_size", &PagePool::page_size)
      .def(
          "acquire", [](PagePool& p, size_t n) { return p.acquire(n); }, py::arg("n"))
      .def(
          "acquire_preferring", [](PagePool& p, const std::vector<PageId>& w) { return p.acquire_preferring(w); },
          py::arg("wanted"))
      .def_property("zero_on_reuse", &PagePool::zero_on_reuse, &PagePool::set_zero_on_reuse)
      .def_property("keep_freed", &PagePool::keep_freed, &PagePool::set_keep_freed)
      .def("zero_pages", &PagePool::zero_pages, py::arg("pages"), py::arg("stream") = 0)
      .def("incref", &PagePool::incref)
      .def("decref", &PagePool::decref)
      .def("attach_file_pages", &PagePool::attach_file_pages, py::arg("fd"), py::arg("offsets"),
           "Ids for pages of a file (one per offset), each with one reference owned by the caller (page_pool.h)")
      .def("is_file_page", &PagePool::is_file_page, py::arg("page"))
      .def("export_pages", &PagePool::export_pages, py::arg("pages"),
           "One new POSIX file descriptor per page in use, the caller's to send and close (CUDA; page_pool.h)")
      .def("import_pages", &PagePool::import_pages, py::arg("fds"),
           "Read-only ids for device pages another process exported, one reference each (page_pool.h)")
      .def("is_imported_page", &PagePool::is_imported_page, py::arg("page"))
      .def("incref_all", &PagePool::incref_all, py::arg("pages"))
      .def("decref_all", &PagePool::decref_all, py::arg("pages"))
      .def("refcount", &PagePool::refcount)
      .def("free_pages", &PagePool::free_pages)
      .def("stats", &PagePool::stats)
      .def("trim", &PagePool::trim)
      .def("set_limit", &PagePool::set_limit, py::arg("pages"))
      .def("release_deferred", &PagePool::release_deferred,
           "Do what a CUDA graph capture deferred, unless one still runs; True when nothing is left pending")
      .def_property_readonly("capture_running", &PagePool::capture_running)
      .def_property_readonly("limit", &PagePool::limit)
      .def("reset_high_water", &PagePool::reset_high_water)
      .def(
          "copy_page",
          [](PagePool& p, PageId dst, PageId src, uintptr_t stream) { p.backend().copy_page(dst, src, stream); },
          py::arg("dst"), py::arg("src"), py::arg("stream") = 0)
      .def(
          "copy_to_host",
          [](PagePool& p, PageId src, uintptr_t host, uintptr_t stream) {
            p.backend().copy_to_host(src, reinterpret_cast<void*>(host), stream);
          },
          py::arg("src"), py::arg("host_ptr"), py::arg("stream") = 0)
      .def(
          "copy_from_host",
          [](PagePool& p, PageId dst, uintptr_t host, uintptr_t stream) {
            p.backend().copy_from_host(dst, reinterpret_cast<const void*>(host), stream);
          },
          py::arg("dst"), py::arg("host_ptr"), py::arg("stream") = 0)
      .def(
          "copy_pages_to_host",
          [](PagePool& p, const std::vector<PageId>& pages, const std::vector<uintptr_t>& hosts, uintptr_t stream) {
            if (pages.size() != hosts.size()) throw InvalidArgument("copy_pages_to_host: pages and host_ptrs differ");
            std::vector<char*> to(hosts.size());
            for (size_t i = 0; i < hosts.size(); ++i) to[i] = reinterpret_cast<char*>(hosts[i]);
            p.backend().copy_pages_to_host(pages.data(), to.data(), pages.size(), stream);
          },
          py::arg("pages"), py::arg("host_ptrs"), py::arg("stream") = 0)
      .def(
          "copy_pages_from_host",
          [](PagePool& p, const std::vector<PageId>& pages, const std::vector<uintptr_t>& hosts, uintptr_t stream) {
            if (pages.size() != hosts.size()) throw InvalidArgument("copy_pages_from_host: pages and host_ptrs differ");
            std::vector<const char*> from(hosts.size());
            for (size_t i = 0; i < hosts.size(); ++i) from[i] = reinterpret_cast<const char*>(hosts[i]);
            p.backend().copy_pages_from_host(pages.data(), from.data(), pages.size(), stream);
          },
          py::arg("pages"), py::arg("host_ptrs"), py::arg("stream") = 0);

  // Page positions in the range are page indices here as in C++ ("slot" is a sequence's row in the caches).
  py::class_<VirtualRange, std::shared_ptr<VirtualRange>>(m, "VirtualRange")
      .def(py::init<std::shared_ptr<PagePool>, size_t>(), py::arg("pool"), py::arg("bytes"))
      .def_property_readonly("address", &VirtualRange::address)
      .def_property_readonly("bytes", &VirtualRange::bytes)
      .def_property_readonly("num_pages", &VirtualRange::num_pages)
      .def_property_readonly("page_size", &VirtualRange::page_size)
      .def_property_readonly("mapped_pages", &VirtualRange::mapped_pages)
      .def(
          "map_new", [](VirtualRange& r, py::handle indices) { return r.map_new(index_list(indices)); },
          py::arg("indices"))
      .def(
          "map_shared",
          [](VirtualRange& r, py::handle indices, py::handle pages) {
            r.map_shared(index_list(indices), index_list(pages));
          },
          py::arg("indices"), py::arg("pages"))
      .def(
          "unmap", [](VirtualRange& r, py::handle indices) { r.unmap(index_list(indices)); }, py::arg("indices"))
      .def("copy_on_write", &VirtualRange::copy_on_write, py::arg("index"), py::arg("stream") = 0)
      .def("make_private", &VirtualRange::make_private, py::arg("indices"), py::arg("stream") = 0)
      .def("copies_needed", &VirtualRange::copies_needed, py::arg("indices"))
      .def("assign", &VirtualRange::assign, py::arg("indices"), py::arg("pages"))
      .def("reorder_runs", &VirtualRange::reorder_runs, py::arg("dst"), py::arg("src"), py::arg("count"),
           py::arg("span"), py::arg("tail"), py::arg("stream") = 0)
      .def("refcounts_at", &VirtualRange::refcounts_at, py::arg("indices"))
      .def("page_at", &VirtualRange::page_at)
      .def("pages_at", &VirtualRange::pages_at)
      .def("pins_at", &VirtualRange::pins_at)
      .def("is_mapped", &VirtualRange::is_mapped, py::arg("offset"), py::arg("length"))
      .def("unmap_all_unpinned", &VirtualRange::unmap_all_unpinned)
      .def("add_stream", &VirtualRange::add_stream, py::arg("stream"))
      .def("remove_stream", &VirtualRange::remove_stream, py::arg("stream"))
      .def_property_readonly("streams", &VirtualRange::streams)
      .def("wait_for_streams", &VirtualRange::wait_for_streams)
      .def(
          "capturing",
          [](VirtualRange& r) {
            if (r.pool().capture_running()) return true;  // the capture flag, or a global-mode capture
            for (uintptr_t stream : r.streams())
              if (r.pool().backend().capturing(stream)) return true;
            return false;
          },
          "Whether a registered stream captures a CUDA graph now (unmap and remap are refused then)")
      .def("pinned_count", &VirtualRange::pinned_count, py::arg("indices"))
      .def(
          "view",
          [](VirtualRange& r, size_t offset, std::vector<int64_t> shape, std::vector<int64_t> strides, int code,
             int bits) {
            void* managed = r.make_dlpack(offset, shape, strides, code, bits);
            return py::capsule(managed, "dltensor", &capsule_destructor);
          },
          py::arg("offset"), py::arg("shape"), py::arg("strides"), py::arg("dtype_code"), py::arg("dtype_bits"),
          "A DLPack capsule of a tensor over mapped memory of this range (strides in elements).");

  register_kernels(m);
  register_torch_allocator(m);
  register_shm_ledger(m);
}
