// RMSNorm (alone or after the residual add), SiLU-and-multiply and the rotary embedding on the CPU, in one pass
// over their rows (see fused_ops.h).
//
// Two builds, picked at run time as the decode kernels' are: the portable x86-64 one (the reference: std::exp,
// scalar loops GCC may vectorise) and AVX2 + FMA, 8 lanes at a time, bf16 widened in registers and rounded to
// bf16 where the eager code rounds (round half to even, as torch). AVX-512 CPUs run the AVX2 build: the ops
// stream each element once and, for prompt-sized activations, already run near the rate of a copy.
//
// SiLU computes sigmoid through e = exp(-|g|), so the exp never leaves its accurate range (x <= 0):
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below.
//
// Rows are split across OpenMP threads once a call has enough elements to pay for waking them (a decode
// step's [64, 1024] norm does not: ~15 us on one core).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/errors.h"
#include "kernels/cpu_math.h"
#include "kernels/decode.h"
#include "kernels/fused_ops.h"

namespace vpaged {
namespace kernels {
namespace {

constexpr int64_t kParallelElems = int64_t(1) << 16;  // fewer elements per call run on the calling thread

// What `.to(dtype)` keeps of an fp32 value: itself, or its bf16 rounding.
template <int DT>
VP_INLINE float round_to(float x) {
  if constexpr (DT == kFloat32) {
    return x;
  } else {
    return Elem<DT>::load(Elem<DT>::store(x));
  }
}

// ------------------------------------------------------------------------------------ portable build
template <int DT>
void rms_norm_rows_base(const void* xv, int64_t xs, const void* wv, void* ov, int64_t os, int64_t r0, int64_t r1,
                        int64_t cols, float eps) {
  using T = typename Elem<DT>::T;
  const T* w = static_cast<const T*>(wv);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(xv) + r * xs;
    T* o = static_cast<T*>(ov) + r * os;
    // The reference build sums in double: its error then does not depend on how the compiler vectorises the
    // loop (the sanitizer build does not), only the AVX2 build's 32 partial fp32 sums differ from it.
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < cols; ++c) {
      const double v = Elem<DT>::load(x[c]);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(float(ss / double(cols)) + eps);
    for (int64_t c = 0; c < cols; ++c)
      o[c] = Elem<DT>::store(Elem<DT>::load(w[c]) * round_to<DT>(Elem<DT>::load(x[c]) * inv));
  }
}

template <int DT>
void add_row_base(const void* xv, void* rv, int64_t cols) {
  using T = typename Elem<DT>::T;
  const T* x = static_cast<const T*>(xv);
  T* res = static_cast<T*>(rv);
  for (int64_t c = 0; c < cols; ++c) res[c] = Elem<DT>::store(Elem<DT>::load(res[c]) + Elem<DT>::load(x[c]));
}

// One head's rotation (fused_ops.h's formula): every product and the sum rounded as the eager code rounds them.
// An fp32 product goes through a register barrier before the sum, so that no FMA merges the two roundings.
template <int DT>
VP_INLINE float rounded_product(float a, float b) {
  float p = a * b;
  if constexpr (DT == kFloat32) {
    asm("" : "+x"(p));
    return p;
  } else {
    return round_to<DT>(p);
  }
}

template <int DT>
void rotary_rows_base(void* xv, int64_t xs, int64_t heads, int64_t dim, const void* cv, const void* sv, int64_t cs,
                      int64_t r0, int64_t r1) {
  using T = typename Elem<DT>::T;
  const int64_t half = dim / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const T* cr = static_cast<const T*>(cv) + r * cs;
    const T* sr = static_cast<const T*>(sv) + r * cs;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = static_cast<T*>(xv) + r * xs + h * dim;
      for (int64_t c = 0; c < half; ++c) {
        const float a = Elem<DT>::load(x[c]), b = Elem<DT>::load(x[c + half]);
        const float lo = rounded_product<DT>(a, Elem<DT>::load(cr[c])) - rounded_product<DT>(b, Elem<DT>::load(sr[c]));
        const float hi =
            rounded_product<DT>(b, Elem<DT>::load(cr[c + half])) + rounded_product<DT>(a, Elem<DT>::load(sr[c + half]));
        x[c] = Elem<DT>::store(lo);
        x[c + half] = Elem<DT>::store(hi);
      }
    }
  }
}

template <int DT>
void silu_mul_rows_base(const void* gv, int64_t gs, const void* uv, int64_t us, void* ov, int64_t os, int64_t r0,
                        int64_t r1, int64_t cols) {
  using T = typename Elem<DT>::T;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(gv) + r * gs;
    const T* u = static_cast<const T*>(uv) + r * us;
    T* o = static_cast<T*>(ov) + r * os;
    for (int64_t c = 0; c < cols; ++c) {
      const float x = Elem<DT>::load(g[c]);
      const float s = round_to<DT>(x / (1.0f + std::exp(-x)));
      o[c] = Elem<DT>::store(s * Elem<DT>::load(u[c]));
    }
  }
}

// ------------------------------------------------------------------------------------ AVX2 build
template <int DT>
VP_AVX2 __m256 round8(__m256 v) {
  if constexpr (DT == kFloat32) {
    return v;
  } else {
    return _mm256_castsi256_ps(bf16_high_bits(v));
  }
}

// A row's last cols % 8 elements go through an 8-element buffer (zero-padded), so every element takes the
// same vector arithmetic.
template <int DT>
struct Tail {
  using T = typename Elem<DT>::T;
  alignas(32) T buf[8] = {};
  VP_INLINE const T* in(const T* src, int n) {
    std::fill(buf, buf + 8, T(0));
    std::copy(src, src + n, buf);
    return buf;
  }
};

template <int DT>
VP_AVX2_TARGET void rms_norm_rows_avx2(const void* xv, int64_t xs, const void* wv, void* ov, int64_t os, int64_t r0,
                                       int64_t r1, int64_t cols, float eps) {
  using T = typename Elem<DT>::T;
  const T* w = static_cast<const T*>(wv);
  const int64_t body = cols / 8 * 8;
  const int tail = int(cols - body);
  Tail<DT> wt, xt;
  const T* w_tail = tail ? wt.in(w + body, tail) : nullptr;
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(xv) + r * xs;
    T* o = static_cast<T*>(ov) + r * os;
    const T* x_tail = tail ? xt.in(x + body, tail) : nullptr;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t c = 0;
    for (; c + 32 <= body; c += 32) {
      const __m256 v0 = load8<DT>(x + c), v1 = load8<DT>(x + c + 8), v2 = load8<DT>(x + c + 16),
                   v3 = load8<DT>(x + c + 24);
      a0 = _mm256_fmadd_ps(v0, v0, a0);
      a1 = _mm256_fmadd_ps(v1, v1, a1);
      a2 = _mm256_fmadd_ps(v2, v2, a2);
      a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    for (; c < body; c += 8) {
      const __m256 v = load8<DT>(x + c);
      a0 = _mm256_fmadd_ps(v, v, a0);
    }
    if (tail) {
      const __m256 v = load8<DT>(x_tail);
      a1 = _mm256_fmadd_ps(v, v, a1);
    }
    const float ss = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(ss / float(cols) + eps));
    for (c = 0; c < body; c += 8) {
      const __m256 t = round8<DT>(_mm256_mul_ps(load8<DT>(x + c), inv));
      store8<DT>(o + c, _mm256_mul_ps(load8<DT>(w + c), t));
    }
    if (tail) {
      T res[8];
      const __m256 t = round8<DT>(_mm256_mul_ps(load8<DT>(x_tail), inv));
      store8<DT>(res, _mm256_mul_ps(load8<DT>(w_tail), t));
      std::copy(res, res + tail, o + body);
    }
  }
}

template <int DT>
VP_AVX2_TARGET void add_row_avx2(const void* xv, void* rv, int64_t cols) {
  using T = typename Elem<DT>::T;
  const T* x = static_cast<const T*>(xv);
  T* res = static_cast<T*>(rv);
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) store8<DT>(res + c, _mm256_add_ps(load8<DT>(res + c), load8<DT>(x + c)));
  for (; c < cols; ++c) res[c] = Elem<DT>::store(Elem<DT>::load(res[c]) + Elem<DT>::load(x[c]));
}

template <int DT>
VP_AVX2 __m256 rounded_product8(__m256 a, __m256 b) {
  __m256 p = _mm256_mul_ps(a, b);
  if constexpr (DT == kFloat32) {
    asm("" : "+x"(p));  // no FMA with the sum: eager rounds the product first
    return p;
  } else {
    return round8<DT>(p);
  }
}

// Heads whose half is a multiple of 8 (64 and 128 dims, ...) take 8 columns of both halves at a time; the others
// run the portable loop (their rows are short).
template <int DT>
VP_AVX2_TARGET void rotary_rows_avx2(void* xv, int64_t xs, int64_t heads, int64_t dim, const void* cv, const void* sv,
                                     int64_t cs, int64_t r0, int64_t r1) {
  using T = typename Elem<DT>::T;
  const int64_t half = dim / 2;
  if (half % 8) {
    rotary_rows_base<DT>(xv, xs, heads, dim, cv, sv, cs, r0, r1);
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const T* cr = static_cast<const T*>(cv) + r * cs;
    const T* sr = static_cast<const T*>(sv) + r * cs;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = static_cast<T*>(xv) + r * xs + h * dim;
      for (int64_t c = 0; c < half; c += 8) {
        const __m256 a = load8<DT>(x + c), b = load8<DT>(x + c + half);
        const __m256 lo =
            _mm256_sub_ps(rounded_product8<DT>(a, load8<DT>(cr + c)), rounded_product8<DT>(b, load8<DT>(sr + c)));
        const __m256 hi = _mm256_add_ps(rounded_product8<DT>(b, load8<DT>(cr + c + half)),
                                        rounded_product8<DT>(a, load8<DT>(sr + c + half)));
        store8<DT>(x + c, lo);
        store8<DT>(x + c + half, hi);
      }
    }
  }
}

template <int DT>
VP_AVX2 __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = exp8(_mm256_or_ps(g, sign));  // exp(-|g|)
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
  return _mm256_mul_ps(round8<DT>(_mm256_mul_ps(g, sig)), u);
}

template <int DT>
VP_AVX2_TARGET void silu_mul_rows_avx2(const void* gv, int64_t gs, const void* uv, int64_t us, void* ov, int64_t os,
                                       int64_t r0, int64_t r1, int64_t cols) {
  using T = typename Elem<DT>::T;
  const int64_t body = cols / 8 * 8;
  const int tail = int(cols - body);
  Tail<DT> gt, ut;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(gv) + r * gs;
    const T* u = static_cast<const T*>(uv) + r * us;
    T* o = static_cast<T*>(ov) + r * os;
    int64_t c = 0;
    for (; c + 16 <= body; c += 16) {
      const __m256 y0 = silu_mul8<DT>(load8<DT>(g + c), load8<DT>(u + c));
      const __m256 y1 = silu_mul8<DT>(load8<DT>(g + c + 8), load8<DT>(u + c + 8));
      store8<DT>(o + c, y0);
      store8<DT>(o + c + 8, y1);
    }
    for (; c < body; c += 8) store8<DT>(o + c, silu_mul8<DT>(load8<DT>(g + c), load8<DT>(u + c)));
    if (tail) {
      T res[8];
      store8<DT>(res, silu_mul8<DT>(load8<DT>(gt.in(g + body, tail)), load8<DT>(ut.in(u + body, tail))));
      std::copy(res, res + tail, o + body);
    }
  }
}

// ------------------------------------------------------------------------------------ dispatch
// The build to run: AVX2 from the AVX2 path up (AVX-512 included), the portable build on baseline.
bool use_avx2(const char* op, int isa) { return resolve_cpu_isa(op, isa) >= kIsaAvx2; }

void check_rows(const char* op, int64_t rows, int64_t cols, int dtype) {
  if (rows < 0 || cols < 1)
    throw InvalidArgument(std::string(op) + ": needs rows >= 0 and cols >= 1, got " + std::to_string(rows) + " x " +
                          std::to_string(cols));
  if (dtype != kFloat32 && dtype != kBFloat16)
    throw InvalidArgument(std::string(op) + ": float32 or bfloat16 only, got dtype code " + std::to_string(dtype));
}

// fn(r0, r1) over [0, rows), split across threads when the call is large enough.
template <typename F>
void for_rows(int64_t rows, int64_t cols, int num_threads, F&& fn) {
  int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (rows * cols < kParallelElems) nt = 1;
  nt = int(std::min<int64_t>(nt, rows));
  if (nt <= 1) {
    fn(int64_t(0), rows);
    return;
  }
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int t = 0; t < nt; ++t) fn(rows * t / nt, rows * (t + 1) / nt);
}

}  // namespace

void rms_norm_cpu(const void* x, int64_t x_stride, const void* weight, void* out, int64_t out_stride, int64_t rows,
                  int64_t cols, float eps, int dtype, int num_threads, int isa) {
  check_rows("rms_norm", rows, cols, dtype);
  if (!(eps >= 0.0f)) throw InvalidArgument("rms_norm: eps must be >= 0, got " + std::to_string(eps));
  const bool avx2 = use_avx2("rms_norm", isa);
  if (rows == 0) return;
  auto* fn = dtype == kFloat32 ? (avx2 ? rms_norm_rows_avx2<kFloat32> : rms_norm_rows_base<kFloat32>)
                               : (avx2 ? rms_norm_rows_avx2<kBFloat16> : rms_norm_rows_base<kBFloat16>);
  for_rows(rows, cols, num_threads,
           [&](int64_t r0, int64_t r1) { fn(x, x_stride, weight, out, out_stride, r0, r1, cols, eps); });
}

void add_rms_norm_cpu(const void* x, int64_t x_stride, void* residual, int64_t residual_stride, const void* weight,
                      void* out, int64_t out_stride, int64_t rows, int64_t cols, float eps, int dtype, int num_threads,
                      int isa) {
  check_rows("add_rms_norm", rows, cols, dtype);
  if (!(eps >= 0.0f)) throw InvalidArgument("add_rms_norm: eps must be >= 0, got " + std::to_string(eps));
  const bool avx2 = use_avx2("add_rms_norm", isa);
  if (rows == 0) return;
  const bool f32 = dtype == kFloat32;
  auto* add = f32 ? (avx2 ? add_row_avx2<kFloat32> : add_row_base<kFloat32>)
                  : (avx2 ? add_row_avx2<kBFloat16> : add_row_base<kBFloat16>);
  auto* norm = f32 ? (avx2 ? rms_norm_rows_avx2<kFloat32> : rms_norm_rows_base<kFloat32>)
                   : (avx2 ? rms_norm_rows_avx2<kBFloat16> : rms_norm_rows_base<kBFloat16>);
  const int64_t elem = f32 ? 4 : 2;
  auto* x_bytes = static_cast<const char*>(x);
  auto* r_bytes = static_cast<char*>(residual);
  for_rows(rows, cols, num_threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // row by row: the sum is still in cache when the norm reads it
      add(x_bytes + r * x_stride * elem, r_bytes + r * residual_stride * elem, cols);
      norm(residual, residual_stride, weight, out, out_stride, r, r + 1, cols, eps);
    }
  });
}

void rotary_cpu(void* x, int64_t x_stride, int64_t heads, int64_t head_dim, const void* cos, const void* sin,
                int64_t cs_stride, int64_t rows, int dtype, int num_threads, int isa) {
  check_rows("rotary", rows, heads * head_dim, dtype);
  if (head_dim < 2 || head_dim % 2)
    throw InvalidArgument("rotary: head_dim must be even and >= 2, got " + std::to_string(head_dim));
  const bool avx2 = use_avx2("rotary", isa);
  if (rows == 0) return;
  auto* fn = dtype == kFloat32 ? (avx2 ? rotary_rows_avx2<kFloat32> : rotary_rows_base<kFloat32>)
                               : (avx2 ? rotary_rows_avx2<kBFloat16> : rotary_rows_base<kBFloat16>);
  for_rows(rows, heads * head_dim, num_threads,
           [&](int64_t r0, int64_t r1) { fn(x, x_stride, heads, head_dim, cos, sin, cs_stride, r0, r1); });
}

void silu_mul_cpu(const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* out,
                  int64_t out_stride, int64_t rows, int64_t cols, int dtype, int num_threads, int isa) {
  check_rows("silu_mul", rows, cols, dtype);
  const bool avx2 = use_avx2("silu_mul", isa);
  if (rows == 0) return;
  auto* fn = dtype == kFloat32 ? (avx2 ? silu_mul_rows_avx2<kFloat32> : silu_mul_rows_base<kFloat32>)
                               : (avx2 ? silu_mul_rows_avx2<kBFloat16> : silu_mul_rows_base<kBFloat16>);
  for_rows(rows, cols, num_threads,
           [&](int64_t r0, int64_t r1) { fn(gate, gate_stride, up, up_stride, out, out_stride, r0, r1, cols); });
}

}  // namespace kernels
}  // namespace vpaged
