// A linear layer's product on the CPU for few rows (decode steps): out = x · Wᵀ (+ bias), W read from a copy packed
// once in column panels, so that each weight is streamed from memory once per call at the rate of a copy while every
// row of the batch takes its products from it.
//
// Why: at decode batch sizes a model's weights do not fit any cache and each product reads all of its weight for a
// handful of rows; general GEMM libraries block for large products there and stream the weight well below the
// memory's rate (oneDNN's packed fp32 products of SmolLM2-135M's 30 layers at 8 rows: ~8 GB/s of weights on a 2-core
// Zen 3 that reads 20+ GB/s; benchmarks/bench_linear.py measures both side by side).
//
// Panel layout (vpaged/ops/linear.py packs it): W [out_features, in_features] as [ceil(out/16), in, 16], panel p
// holding output features 16p..16p+15 with their in_features values k-major (element [p][k][j] = W[16p + j][k]),
// zero past out_features. The panels are float32 or bfloat16 (kFloat32 / kBFloat16 of decode.h); bf16 weights are
// widened in registers (exactly: a bf16 value is an fp32 value), so a bf16 model streams half the bytes.
//
// x and out are [rows, in] / [rows, out] of one dtype (float32 or bfloat16), rows `*_stride` elements apart, the
// last dim dense; bias (x's dtype) or null. Every output is one fp32 sum over k in order (a fused multiply-add per
// step on the AVX2 build), bias added after, rounded once to out's dtype: as far from the exact product as any fp32
// dot product of that length (tests/ops/test_linear.py bounds it against float64).
#pragma once
#include <cstdint>

namespace vpaged {
namespace kernels {

constexpr int64_t kLinearPanelWidth = 16;

// Throws InvalidArgument on bad sizes or dtypes, or for a path this CPU lacks (isa as decode_cpu's; AVX-512 CPUs run
// the AVX2 build: the product streams its weight, and 8 lanes already keep up with the memory there).
void linear_panels_cpu(const void* x, int64_t x_stride, int64_t rows, int64_t in_features, const void* panels,
                       int weight_dtype, int64_t out_features, const void* bias, void* out, int64_t out_stride,
                       int dtype, int num_threads, int isa);

}  // namespace kernels
}  // namespace vpaged
