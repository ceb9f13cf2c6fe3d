// Python bindings of the attention kernels. Parameters are plain structs whose tensor fields are integer
// addresses (tensor.data_ptr()): the extension does not link libtorch, vpaged/ops/ does the checking.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/errors.h"
#include "kernels/decode.h"

namespace py = pybind11;

namespace {

// An address field exposed to Python as an int.
template <typename C, typename P>
void address_field(py::class_<C>& cls, const char* name, P C::* field) {
  cls.def_property(
      name, [field](const C& c) { return reinterpret_cast<uintptr_t>(c.*field); },
      [field](C& c, uintptr_t v) { c.*field = reinterpret_cast<P>(v); });
}

int isa_code(const std::string& isa) {
  const int code = vpaged::kernels::cpu_isa_from_name(isa);
  if (code == -2)
    throw vpaged::InvalidArgument("isa must be auto, baseline, avx2, avx512, avx512bf16 or amx, got " + isa);
  return code;
}

// Every length in 1..capacity (the longest is returned): checked before any kernel reads memory.
int32_t check_lengths(const std::vector<int32_t>& lengths, int32_t capacity) {
  int32_t longest = 1;
  for (const int32_t n : lengths) {
    if (n < 1 || n > capacity)
      throw vpaged::InvalidArgument("decode attention: a length of " + std::to_string(n) + " is outside 1.." +
                                    std::to_string(capacity));
    longest = std::max(longest, n);
  }
  return longest;
}

// Block tables of a PagedKVCache step, as the kernel reads them: sequence b's first ceil(lengths[b] /
// block_size) block ids, each checked to lie in 0..num_blocks-1 (a bad table is an error, never clamped),
// copied into one dense [num_seqs, width] array (width: the longest sequence's blocks; rows padded with 0,
// which the kernel never reads). Returns width.
int64_t dense_block_tables(const std::vector<std::vector<int64_t>>& tables, const std::vector<int32_t>& lengths,
                           int block_size, int32_t num_blocks, std::vector<int32_t>& dense) {
  if (tables.size() != lengths.size())
    throw vpaged::InvalidArgument("decode attention: " + std::to_string(tables.size()) + " block tables for " +
                                  std::to_string(lengths.size()) + " lengths");
  // Every table is long enough before anything is allocated: the dense array is at most the tables' size.
  int64_t width = 1;
  for (size_t b = 0; b < tables.size(); ++b) {
    const size_t used = size_t((int64_t(lengths[b]) + block_size - 1) / block_size);
    if (tables[b].size() < used)
      throw vpaged::InvalidArgument("decode attention: sequence " + std::to_string(b) + " holds " +
                                    std::to_string(lengths[b]) + " tokens, " + std::to_string(used) +
                                    " blocks, but its block table has " + std::to_string(tables[b].size()));
    width = std::max<int64_t>(width, int64_t(used));
  }
  dense.assign(tables.size() * size_t(width), 0);
  for (size_t b = 0; b < tables.size(); ++b) {
    const size_t used = size_t((int64_t(lengths[b]) + block_size - 1) / block_size);
    for (size_t i = 0; i < used; ++i) {
      const int64_t blk = tables[b][i];
      if (blk < 0 || blk >= num_blocks)
        throw vpaged::InvalidArgument("decode attention: block " + std::to_string(blk) + " (entry " +
                                      std::to_string(i) + " of sequence " + std::to_string(b) +
                                      "'s table) is outside 0.." + std::to_string(num_blocks - 1));
      dense[b * size_t(width) + i] = int32_t(blk);
    }
  }
  return width;
}

// base with the per-call fields of a step: query, output, heads, scale, lengths (checked) and max_tokens.
vpaged::kernels::DecodeParams step_params(const vpaged::kernels::DecodeParams& base, uintptr_t q, uintptr_t out,
                                          int num_heads, float scale, const std::vector<int32_t>& lengths) {
  vpaged::kernels::DecodeParams p = base;
  p.q = reinterpret_cast<const void*>(q);
  p.out = reinterpret_cast<void*>(out);
  p.num_heads = num_heads;
  p.scale = scale;
  p.num_seqs = int(lengths.size());
  p.lengths = lengths.data();
  p.max_tokens = check_lengths(lengths, base.max_tokens);
  return p;
}

}  // namespace

void register_write_kv(py::module_& m);   // at the end of this file
void register_fused_ops(py::module_& m);  // at the end of this file
void register_linear(py::module_& m);     // at the end of this file

void register_kernels(py::module_& m) {
  using namespace vpaged::kernels;
  py::class_<DecodeParams> params(m, "DecodeParams",
                                  "Arguments of a decode attention launch (see csrc/kernels/decode.h).");
  params.def(py::init<>())
      .def_readwrite("dtype", &DecodeParams::dtype)
      .def_readwrite("kv_dtype", &DecodeParams::kv_dtype)
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
      .def_readwrite("scale", &DecodeParams::scale)
      .def_readwrite("k_scale", &DecodeParams::k_scale)
      .def_readwrite("v_scale", &DecodeParams::v_scale);
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

  m.def(
      "dtype_codes",
      [] {
        // decode.h's DType, keyed by the torch dtype's name: vpaged/ops/launch.py reads its codes from here.
        py::dict codes;
        codes["float32"] = int(kFloat32);
        codes["float16"] = int(kFloat16);
        codes["bfloat16"] = int(kBFloat16);
        codes["int8"] = int(kInt8);
        codes["float8_e4m3fn"] = int(kFloat8E4M3);
        codes["float8_e5m2"] = int(kFloat8E5M2);
        return codes;
      },
      "The element type codes of the kernels' dtype / kv_dtype fields, by torch dtype name.");
  m.def("decode_check", &check_params, py::arg("params"), "Raise InvalidArgumentError if params are inconsistent.");
  m.def(
      "decode_cpu",
      [](const DecodeParams& p, int num_threads, const std::string& isa) {
        const int code = isa_code(isa);
        py::gil_scoped_release release;
        decode_cpu(p, num_threads, code);
      },
      py::arg("params"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "Decode attention on the CPU (blocking). isa: auto (the best this CPU has), baseline, avx2, avx512, "
      "avx512bf16 or amx.");
  // The per-call path of decode_attention on a cache: the layer's geometry comes prebuilt (base), the call
  // adds what changes per step. Slots and lengths arrive as lists and live in C++ for the call, so a step
  // builds no tensors; base.max_tokens is the capacity per sequence, and every length is checked against
  // it here, before any kernel reads memory.
  m.def(
      "decode_cpu_rows",
      [](const DecodeParams& base, uintptr_t q, uintptr_t out, int num_heads, float scale,
         const std::vector<int32_t>& slots, const std::vector<int32_t>& lengths, int num_threads,
         const std::string& isa) {
        if (slots.size() != lengths.size())
          throw vpaged::InvalidArgument("decode attention: " + std::to_string(slots.size()) + " slots for " +
                                        std::to_string(lengths.size()) + " lengths");
        DecodeParams p = step_params(base, q, out, num_heads, scale, lengths);
        p.slots = slots.data();
        const int code = isa_code(isa);
        py::gil_scoped_release release;
        decode_cpu(p, num_threads, code);
      },
      py::arg("base"), py::arg("q"), py::arg("out"), py::arg("num_heads"), py::arg("scale"), py::arg("slots"),
      py::arg("lengths"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "Contiguous decode attention on the CPU over base's K/V for (slots, lengths) lists (blocking).");
  // The same for a PagedKVCache: base describes the layer's block pools (max_tokens: the capacity per
  // sequence), the call adds each sequence's block table as a list of ids. Lengths and every block id a
  // length reaches are checked here before any kernel reads memory: a bad table raises and writes nothing.
  m.def(
      "decode_cpu_tables",
      [](const DecodeParams& base, uintptr_t q, uintptr_t out, int num_heads, float scale,
         const std::vector<std::vector<int64_t>>& block_tables, const std::vector<int32_t>& lengths, int num_threads,
         const std::string& isa) {
        if (!base.paged || base.block_size <= 0 || (base.block_size & (base.block_size - 1)) != 0)
          throw vpaged::InvalidArgument("decode attention: base does not describe block pools");
        DecodeParams p = step_params(base, q, out, num_heads, scale, lengths);
        std::vector<int32_t> dense;
        p.bt_stride = dense_block_tables(block_tables, lengths, base.block_size, base.num_blocks, dense);
        p.block_tables = dense.data();
        const int code = isa_code(isa);
        py::gil_scoped_release release;
        decode_cpu(p, num_threads, code);
      },
      py::arg("base"), py::arg("q"), py::arg("out"), py::arg("num_heads"), py::arg("scale"), py::arg("block_tables"),
      py::arg("lengths"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "Block-table decode attention on the CPU over base's block pools for (block_tables, lengths) lists "
      "(blocking).");
  m.def(
      "decode_cpu_isas",
      [] {
        py::list l;
        for (int i = kIsaBaseline; i <= cpu_best_isa(); ++i) l.append(cpu_isa_name(i));
        return l;
      },
      "The CPU code paths of the decode kernels this CPU can run, portable first.");
  m.def(
      "decode_cpu_int8_dot", [](const std::string& isa) { return cpu_int8_dot(isa_code(isa)); },
      py::arg("isa") = "auto",
      "Whether int8 K/V decode on this CPU code path takes integer products of a quantized query and probabilities "
      "(VNNI on avx512bf16 and amx, 16-bit on avx2: an accuracy contract of its own, csrc/kernels/decode_cpu_tiles.h) "
      "instead of fp32 products.");
  m.def(
      "decode_cpu_int8_dot_prob_steps", [](const std::string& isa) { return cpu_int8_dot_prob_steps(isa_code(isa)); },
      py::arg("isa") = "auto",
      "The steps int8 decode's integer products quantize a chunk's probabilities to on this CPU code path (the "
      "contract's 255 or 32767), 0 where it takes fp32 products.");
  m.def(
      "cpu_auto_isa", [] { return std::string(cpu_isa_name(cpu_auto_isa())); },
      "The CPU code path isa='auto' runs: the best this CPU has, capped by VPAGED_CPU_ISA.");
  m.def("decode_cuda", &decode_cuda, py::arg("params"), py::arg("launch"), py::call_guard<py::gil_scoped_release>(),
        "Decode attention on CUDA (asynchronous on launch.stream).");
  m.def("kernels_built_with_cuda", &kernels_built_with_cuda);
  register_write_kv(m);
  register_fused_ops(m);
  register_linear(m);
}

// The K/V scatter (csrc/kernels/write_kv.h): its own parameter struct and entry points.
#include "kernels/write_kv.h"

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

// The fused element-wise ops of a forward (csrc/kernels/fused_ops.h): addresses and strides in elements;
// vpaged/ops/fused.py checks the tensors.
#include "kernels/fused_ops.h"

void register_fused_ops(py::module_& m) {
  using namespace vpaged::kernels;
  m.def(
      "rms_norm_cpu",
      [](uintptr_t x, int64_t x_stride, uintptr_t weight, uintptr_t out, int64_t out_stride, int64_t rows, int64_t cols,
         float eps, int dtype, int num_threads, const std::string& isa) {
        const int code = isa_code(isa);
        py::gil_scoped_release release;
        rms_norm_cpu(reinterpret_cast<const void*>(x), x_stride, reinterpret_cast<const void*>(weight),
                     reinterpret_cast<void*>(out), out_stride, rows, cols, eps, dtype, num_threads, code);
      },
      py::arg("x"), py::arg("x_stride"), py::arg("weight"), py::arg("out"), py::arg("out_stride"), py::arg("rows"),
      py::arg("cols"), py::arg("eps"), py::arg("dtype"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "RMSNorm of [rows, cols] rows times weight (CPU, blocking).");
  m.def(
      "silu_mul_cpu",
      [](uintptr_t gate, int64_t gate_stride, uintptr_t up, int64_t up_stride, uintptr_t out, int64_t out_stride,
         int64_t rows, int64_t cols, int dtype, int num_threads, const std::string& isa) {
        const int code = isa_code(isa);
        py::gil_scoped_release release;
        silu_mul_cpu(reinterpret_cast<const void*>(gate), gate_stride, reinterpret_cast<const void*>(up), up_stride,
                     reinterpret_cast<void*>(out), out_stride, rows, cols, dtype, num_threads, code);
      },
      py::arg("gate"), py::arg("gate_stride"), py::arg("up"), py::arg("up_stride"), py::arg("out"),
      py::arg("out_stride"), py::arg("rows"), py::arg("cols"), py::arg("dtype"), py::arg("num_threads") = 0,
      py::arg("isa") = "auto", "silu(gate) * up over [rows, cols] rows (CPU, blocking).");
  m.def(
      "add_rms_norm_cpu",
      [](uintptr_t x, int64_t x_stride, uintptr_t residual, int64_t residual_stride, uintptr_t weight, uintptr_t out,
         int64_t out_stride, int64_t rows, int64_t cols, float eps, int dtype, int num_threads,
         const std::string& isa) {
        const int code = isa_code(isa);
        py::gil_scoped_release release;
        add_rms_norm_cpu(reinterpret_cast<const void*>(x), x_stride, reinterpret_cast<void*>(residual), residual_stride,
                         reinterpret_cast<const void*>(weight), reinterpret_cast<void*>(out), out_stride, rows, cols,
                         eps, dtype, num_threads, code);
      },
      py::arg("x"), py::arg("x_stride"), py::arg("residual"), py::arg("residual_stride"), py::arg("weight"),
      py::arg("out"), py::arg("out_stride"), py::arg("rows"), py::arg("cols"), py::arg("eps"), py::arg("dtype"),
      py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "residual += x, then the RMSNorm of residual's [rows, cols] rows times weight into out (CPU, blocking).");
  m.def(
      "rotary_cpu",
      [](uintptr_t x, int64_t x_stride, int64_t heads, int64_t head_dim, uintptr_t cos, uintptr_t sin,
         int64_t cs_stride, int64_t rows, int dtype, int num_threads, const std::string& isa) {
        const int code = isa_code(isa);
        py::gil_scoped_release release;
        rotary_cpu(reinterpret_cast<void*>(x), x_stride, heads, head_dim, reinterpret_cast<const void*>(cos),
                   reinterpret_cast<const void*>(sin), cs_stride, rows, dtype, num_threads, code);
      },
      py::arg("x"), py::arg("x_stride"), py::arg("heads"), py::arg("head_dim"), py::arg("cos"), py::arg("sin"),
      py::arg("cs_stride"), py::arg("rows"), py::arg("dtype"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "Rotate-half rotary embedding of [rows, heads, head_dim] rows in place (CPU, blocking).");
}

// The small-batch linear product on panels (csrc/kernels/linear_cpu.h): addresses and strides in elements;
// vpaged/ops/linear.py packs the panels and checks the tensors.
#include "kernels/linear_cpu.h"

void register_linear(py::module_& m) {
  using namespace vpaged::kernels;
  m.attr("LINEAR_PANEL_WIDTH") = kLinearPanelWidth;
  m.def(
      "linear_panels_cpu",
      [](uintptr_t x, int64_t x_stride, int64_t rows, int64_t in_features, uintptr_t panels, int weight_dtype,
         int64_t out_features, uintptr_t bias, uintptr_t out, int64_t out_stride, int dtype, int num_threads,
         const std::string& isa) {
        const int code = isa_code(isa);
        py::gil_scoped_release release;
        linear_panels_cpu(reinterpret_cast<const void*>(x), x_stride, rows, in_features,
                          reinterpret_cast<const void*>(panels), weight_dtype, out_features,
                          reinterpret_cast<const void*>(bias), reinterpret_cast<void*>(out), out_stride, dtype,
                          num_threads, code);
      },
      py::arg("x"), py::arg("x_stride"), py::arg("rows"), py::arg("in_features"), py::arg("panels"),
      py::arg("weight_dtype"), py::arg("out_features"), py::arg("bias"), py::arg("out"), py::arg("out_stride"),
      py::arg("dtype"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "out = x @ W.T (+ bias) for [rows, in_features] rows, W packed in 16-wide column panels (CPU, blocking; bias 0 "
      "= none).");
}
