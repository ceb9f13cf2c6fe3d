// vpaged_bench_ext: the C++ that only benchmarks/bench_mapping.py needs, kept out of vpaged._C so the library
// ships no benchmark code. benchmarks/common.py builds it on first use (bench_ext()) into build/bench_ext/.
//
// The per-page backend is a vpaged::Backend (csrc/core/backend.h) and is handed to vpaged._C.PagePool: the
// two modules share pybind11's type registry, so this module must be compiled with the same pybind11 headers
// and compiler as vpaged._C, and imports vpaged._C first (its Backend class is registered there).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "core/backend.h"

namespace py = pybind11;

namespace vpaged {
std::shared_ptr<Backend> make_per_page_host_backend(size_t page_size, size_t capacity_pages);  // per_page_backend.cpp
double raw_map_unmap_seconds_per_page(size_t page_size, size_t pages, const std::string& design,
                                      bool touch);  // raw_map_unmap.cpp
}  // namespace vpaged

PYBIND11_MODULE(vpaged_bench_ext, m) {
  m.doc() = "vpaged benchmark references: the per-page host backend and the bare map + unmap loops";
  py::module_::import("vpaged._C");  // registers vpaged::Backend, the type per_page_host_backend returns
  m.def("per_page_host_backend", &vpaged::make_per_page_host_backend, py::arg("page_size"), py::arg("capacity_pages"),
        "Benchmark reference: the host backend that maps every page on its own (bench_mapping.py).");
  m.def("raw_map_unmap_seconds_per_page", &vpaged::raw_map_unmap_seconds_per_page, py::arg("page_size"),
        py::arg("pages"), py::arg("design") = "home", py::arg("touch") = false,
        "Benchmark floor: the bare system calls that map + unmap one page, in C++, for one host design "
        "('per_page': mmap of a memfd page + PROT_NONE over it; 'anon': MADV_DONTNEED in an anonymous "
        "mapping; 'home': punch the page's hole in a range-long memfd mapping). touch: write each page once.");
}
