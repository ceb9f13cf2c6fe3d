// Element-wise work of a decoder layer's forward, fused into one pass over its rows (CPU): the RMSNorm of
// Llama-family models and the SiLU-and-multiply of their gated MLPs. Eager PyTorch runs each as 2-7 kernels,
// each a full pass over the activations (read and write) plus its dispatch. vpaged/hf/fused.py swaps the
// modules that use them; vpaged/ops/fused.py checks the tensors and fills these calls.
//
// Tensors are 2-d [rows, cols], all of one dtype (kFloat32 or kBFloat16 of decode.h), each row dense, rows
// `*_stride` elements apart. The results follow eager PyTorch's rounding (bf16: every intermediate the eager
// code rounds to bf16 is rounded here too), up to the order of the sum of squares and the exp polynomial:
// within a few ulp of the eager result (tests/test_fused_ops.py bounds it against float64).
#pragma once
#include <cstdint>

namespace vpaged {
namespace kernels {

// out = weight * (x * rsqrt(mean(x^2) + eps)), the mean in fp32 over each row's cols (bf16: x * rsqrt(...)
// rounded to bf16, then multiplied by weight and rounded again, as LlamaRMSNorm does). out may be x.
void rms_norm_cpu(const void* x, int64_t x_stride, const void* weight, void* out, int64_t out_stride, int64_t rows,
                  int64_t cols, float eps, int dtype, int num_threads, int isa);

// out = silu(gate) * up (bf16: silu(gate) rounded to bf16, then the product rounded). out may be gate or up.
void silu_mul_cpu(const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* out,
                  int64_t out_stride, int64_t rows, int64_t cols, int dtype, int num_threads, int isa);

}  // namespace kernels
}  // namespace vpaged
