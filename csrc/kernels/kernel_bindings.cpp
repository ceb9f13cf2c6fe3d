// Python bindings of the attention kernels. Parameters are plain structs whose tensor fields are integer
// addresses (tensor.data_ptr()): the extension does not link libtorch, vpaged/ops.py does the checking.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "../errors.h"
#include "decode.h"

namespace py = pybind11;

namespace vpaged {
namespace kernels {

#ifndef VPAGED_WITH_CUDA
// No CUDA toolkit at build time: the CUDA entry points exist but say why they cannot run.
bool kernels_built_with_cuda() { return false; }
void decode_cuda(const DecodeParams&, const CudaLaunch&) {
  throw BackendUnavailable(
      "vpaged was built without CUDA: the CUDA decode kernels are not in this build "
      "(rebuild where a CUDA toolkit with bin/nvcc and include/cuda.h is found)");
}
#endif

}  // namespace kernels
}  // namespace vpaged

namespace {

// An address field exposed to Python as an int.
template <typename C, typename P>
void address_field(py::class_<C>& cls, const char* name, P C::* field) {
  cls.def_property(
      name, [field](const C& c) { return reinterpret_cast<uintptr_t>(c.*field); },
      [field](C& c, uintptr_t v) { c.*field = reinterpret_cast<P>(v); });
}

}  // namespace

void register_write_kv(py::module_& m);  // at the end of this file

void register_kernels(py::module_& m) {
  using namespace vpaged::kernels;
  py::class_<DecodeParams> params(m, "DecodeParams",
                                  "Arguments of a decode attention launch (see csrc/kernels/decode.h).");
  params.def(py::init<>())
      .def_readwrite("dtype", &DecodeParams::dtype)
      .def_readwrite("num_seqs", &DecodeParams::num_seqs)
      .def_readwrite("num_heads", &DecodeParams::num_heads)
      .def_readwrite("num_kv_heads", &DecodeParams::num_kv_heads)
      .def_readwrite("head_dim", &DecodeParams::head_dim)
      .def_readwrite("v_head_dim", &DecodeParams::v_head_dim)
      .def_readwrite("token_stride", &DecodeParams::token_stride)
      .def_readwrite("head_stride", &DecodeParams::head_stride)
      .def_readwrite("v_token_stride", &DecodeParams::v_token_stride)
      .def_readwrite("v_head_stride", &DecodeParams::v_head_stride)
      .def_readwrite("max_tokens", &DecodeParams::max_tokens)
      .def_readwrite("paged", &DecodeParams::paged)
      .def_readwrite("slot_stride", &DecodeParams::slot_stride)
      .def_readwrite("v_slot_stride", &DecodeParams::v_slot_stride)
      .def_readwrite("bt_stride", &DecodeParams::bt_stride)
      .def_readwrite("block_size", &DecodeParams::block_size)
      .def_readwrite("num_blocks", &DecodeParams::num_blocks)
      .def_readwrite("scale", &DecodeParams::scale);
  address_field(params, "q", &DecodeParams::q);
  address_field(params, "out", &DecodeParams::out);
  address_field(params, "k", &DecodeParams::k);
  address_field(params, "v", &DecodeParams::v);
  address_field(params, "lengths", &DecodeParams::lengths);
  address_field(params, "slots", &DecodeParams::slots);
  address_field(params, "block_tables", &DecodeParams::block_tables);

  py::class_<CudaLaunch> launch(m, "CudaLaunch", "Device, stream and context split of a CUDA decode launch.");
  launch.def(py::init<>())
      .def_readwrite("device", &CudaLaunch::device)
      .def_readwrite("stream", &CudaLaunch::stream)
      .def_readwrite("num_splits", &CudaLaunch::num_splits)
      .def_readwrite("split_tokens", &CudaLaunch::split_tokens);
  address_field(launch, "partial_acc", &CudaLaunch::partial_acc);
  address_field(launch, "partial_ml", &CudaLaunch::partial_ml);

  m.def("decode_check", &check_params, py::arg("params"), "Raise InvalidArgumentError if params are inconsistent.");
  m.def(
      "decode_cpu",
      [](const DecodeParams& p, int num_threads, const std::string& isa) {
        int code = kIsaAuto;
        if (isa == "baseline")
          code = kIsaBaseline;
        else if (isa == "avx2")
          code = kIsaAvx2;
        else if (isa == "avx512")
          code = kIsaAvx512;
        else if (isa != "auto")
          throw vpaged::InvalidArgument("isa must be auto, baseline, avx2 or avx512, got " + isa);
        py::gil_scoped_release release;
        decode_cpu(p, num_threads, code);
      },
      py::arg("params"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "Decode attention on the CPU (blocking). isa: auto (the best this CPU has), baseline, avx2 or avx512.");
  m.def(
      "decode_cpu_isas",
      [] {
        py::list l;
        const char* names[] = {"baseline", "avx2", "avx512"};
        for (int i = 0; i <= cpu_best_isa(); ++i) l.append(names[i]);
        return l;
      },
      "The CPU code paths of the decode kernels this CPU can run, portable first.");
  m.def("decode_cuda", &decode_cuda, py::arg("params"), py::arg("launch"), py::call_guard<py::gil_scoped_release>(),
        "Decode attention on CUDA (asynchronous on launch.stream).");
  m.def("kernels_built_with_cuda", &kernels_built_with_cuda);
  register_write_kv(m);
}

// The K/V scatter (csrc/kernels/write_kv.h): its own parameter struct and entry points.
#include "write_kv.h"

void register_write_kv(py::module_& m) {
  using namespace vpaged::kernels;
  py::class_<WriteKVParams> params(m, "WriteKVParams",
                                   "Arguments of a K/V scatter into a contiguous cache (see csrc/kernels/write_kv.h).");
  params.def(py::init<>())
      .def_readwrite("itemsize", &WriteKVParams::itemsize)
      .def_readwrite("num_rows", &WriteKVParams::num_rows)
      .def_readwrite("num_seqs", &WriteKVParams::num_seqs)
      .def_readwrite("num_kv_heads", &WriteKVParams::num_kv_heads)
      .def_readwrite("head_dim", &WriteKVParams::head_dim)
      .def_readwrite("v_head_dim", &WriteKVParams::v_head_dim)
      .def_readwrite("k_row_stride", &WriteKVParams::k_row_stride)
      .def_readwrite("k_head_stride", &WriteKVParams::k_head_stride)
      .def_readwrite("v_row_stride", &WriteKVParams::v_row_stride)
      .def_readwrite("v_head_stride", &WriteKVParams::v_head_stride)
      .def_readwrite("slot_stride", &WriteKVParams::slot_stride)
      .def_readwrite("token_stride", &WriteKVParams::token_stride)
      .def_readwrite("head_stride", &WriteKVParams::head_stride)
      .def_readwrite("v_slot_stride", &WriteKVParams::v_slot_stride)
      .def_readwrite("v_token_stride", &WriteKVParams::v_token_stride)
      .def_readwrite("v_cache_head_stride", &WriteKVParams::v_cache_head_stride)
      .def_readwrite("extent_lo", &WriteKVParams::extent_lo)
      .def_readwrite("extent_hi", &WriteKVParams::extent_hi)
      .def_readwrite("v_extent_lo", &WriteKVParams::v_extent_lo)
      .def_readwrite("v_extent_hi", &WriteKVParams::v_extent_hi);
  address_field(params, "k", &WriteKVParams::k);
  address_field(params, "v", &WriteKVParams::v);
  address_field(params, "k_cache", &WriteKVParams::k_cache);
  address_field(params, "v_cache", &WriteKVParams::v_cache);
  address_field(params, "slots", &WriteKVParams::slots);
  address_field(params, "lengths", &WriteKVParams::lengths);
  address_field(params, "writable_from", &WriteKVParams::writable_from);
  address_field(params, "rows", &WriteKVParams::rows);
  address_field(params, "positions", &WriteKVParams::positions);
  m.def("write_kv_check", &write_kv_check, py::arg("params"),
        "Raise InvalidArgumentError unless every row may be written (host index arrays).");
  m.def("write_kv_cpu", &write_kv_cpu, py::arg("params"), py::arg("num_threads") = 0,
        py::call_guard<py::gil_scoped_release>(), "Check every row, then scatter the K/V rows (CPU, blocking).");
  m.def("write_kv_cuda", &write_kv_cuda, py::arg("params"), py::arg("device"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>(), "Scatter the K/V rows on CUDA (asynchronous on `stream`).");
}
