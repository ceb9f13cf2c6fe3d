// Element-wise work of a decoder layer's forward, fused into one pass over its rows (CPU): the RMSNorm of
// Llama-family models (alone, or after the residual add before it), the SiLU-and-multiply of their gated MLPs
// and the rotary position embedding of their queries and keys. Eager PyTorch runs each as 2-7 kernels,
// each a full pass over the activations (read and write) plus its dispatch. vpaged/hf/fused.py swaps the
// modules that use them, vpaged/serve/direct_forward.py calls them from its layer walk; vpaged/ops/fused.py
// checks the tensors and fills these calls.
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

// residual = residual + x, rounded to the dtype as eager `residual + hidden_states` is; then out = the
// rms_norm_cpu of the new residual. One pass over x and residual per row. out may be x, not residual.
void add_rms_norm_cpu(const void* x, int64_t x_stride, void* residual, int64_t residual_stride, const void* weight,
                      void* out, int64_t out_stride, int64_t rows, int64_t cols, float eps, int dtype, int num_threads,
                      int isa);

// Rotary position embedding in place, in the rotate-half form of Llama-family models: each row r holds `heads`
// heads of head_dim (even) dims back to back, rows x_stride apart; with half = head_dim / 2 and c < half,
//   x[c]        <- x[c] * cos[r][c] - x[c + half] * sin[r][c]
//   x[c + half] <- x[c + half] * cos[r][c + half] + x[c] * sin[r][c + half]
// cos and sin [rows, head_dim], rows cs_stride apart, of x's dtype, shared by the row's heads. Each product and
// the sum are rounded to the dtype, as eager (x * cos) + (rotate_half(x) * sin) rounds them.
void rotary_cpu(void* x, int64_t x_stride, int64_t heads, int64_t head_dim, const void* cos, const void* sin,
                int64_t cs_stride, int64_t rows, int dtype, int num_threads, int isa);

// out = silu(gate) * up (bf16: silu(gate) rounded to bf16, then the product rounded). out may be gate or up.
void silu_mul_cpu(const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* out,
                  int64_t out_stride, int64_t rows, int64_t cols, int dtype, int num_threads, int isa);

}  // namespace kernels
}  // namespace vpaged
