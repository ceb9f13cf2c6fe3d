// Decode attention on CUDA (contiguous and block-table K/V; see decode.h).
//
// One thread block handles GT query heads that share one kv head (GQA: K/V are read once for all GT) of
// one sequence, over one piece of its tokens (the whole sequence in the one-pass launch). Its 4 warps
// take tokens round-robin; inside a warp, LPT lanes cooperate on one token (each lane holds 16 bytes of
// the row, so a group's load is one coalesced 16-byte-per-lane access) and 32 / LPT tokens are processed
// per warp step, the next step's rows already loading (a two-stage register pipeline). Every lane group keeps its own
// online softmax (max, sum, output slice) in registers, so the token loop has no barrier; groups merge by shuffles,
// warps through shared memory, at the end.
//
// Long contexts with few sequences would leave most SMs idle, so the host (vpaged/ops/) then cuts each
// sequence into pieces of split_tokens: pass 1 writes each piece's (max, sum, unnormalised output),
// pass 2 (merge_kernel) combines them. Scores live in the log2 domain (q pre-scaled by log2 e) so the
// exponentials are exp2f.
//
// Quantized K/V (1-byte elements, fp32 q and out; see decode.h) take the same kernel with a 1-byte element
// type: lanes load their 16 (or more) bytes of a row and dequantize them in registers. fp8 scales are per
// tensor, so k_scale folds into q and v_scale into the output; an int8 row's scale (the float32 after its
// values) is loaded next to the row and multiplies the token's score (K) or probability (V). int8 rows are
// head_dim + 4 bytes, so their lanes load 4-byte words (rows need only 4-byte alignment); fp8 rows load
// 16-byte vectors like the other types.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/errors.h"
#include "kernels/cuda_guard.h"
#include "kernels/decode.h"

namespace vpaged {
namespace kernels {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxSplits = 4096;  // merge_kernel keeps one weight per split in shared memory

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static constexpr int kPerWord = 1;
  __device__ static __forceinline__ void unpack(uint32_t w, float* f) { f[0] = __uint_as_float(w); }
  __device__ static __forceinline__ float store(float x) { return x; }
};
template <>
struct Cvt<__half> {
  static constexpr int kPerWord = 2;
  __device__ static __forceinline__ void unpack(uint32_t w, float* f) {
    f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  __device__ static __forceinline__ __half store(float x) { return __float2half_rn(x); }
};
template <>
struct Cvt<__nv_bfloat16> {
  static constexpr int kPerWord = 2;
  __device__ static __forceinline__ void unpack(uint32_t w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  __device__ static __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// N elements at src (16-byte aligned, N * sizeof(T) a multiple of 16) as raw 16-byte vectors, and their
// conversion to floats: loads are issued a token ahead of their use (see decode_kernel), so the raw form,
// half the registers for 16-bit types, is what waits in flight.
// The 1-byte K/V formats as element types (their bytes are only ever read through Cvt).
struct KvInt8 {
  uint8_t bits;
};
struct KvE4M3 {
  uint8_t bits;
};
struct KvE5M2 {
  uint8_t bits;
};

// fp8 through fp16 bits: e5m2 is an fp16's high byte; e4m3's 7 low bits shifted up by 7 are an fp16 of 2^-8
// times its value (normal and subnormal; the 2^8 is folded into k_scale / v_scale by the host, see
// fp8_factor). Exact for every finite byte.
__device__ __forceinline__ float e5m2_to_float(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>((b & 0xffu) << 8)));
}
__device__ __forceinline__ float e4m3_to_float_2m8(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))));
}

template <>
struct Cvt<KvInt8> {
  static constexpr int kPerWord = 4;
  __device__ static __forceinline__ void unpack(uint32_t w, float* f) {
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = float(static_cast<int8_t>(static_cast<uint8_t>(w >> (8 * j))));
  }
};
template <>
struct Cvt<KvE4M3> {
  static constexpr int kPerWord = 4;
  __device__ static __forceinline__ void unpack(uint32_t w, float* f) {
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = e4m3_to_float_2m8(w >> (8 * j));
  }
};
template <>
struct Cvt<KvE5M2> {
  static constexpr int kPerWord = 4;
  __device__ static __forceinline__ void unpack(uint32_t w, float* f) {
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = e5m2_to_float(w >> (8 * j));
  }
};

// The word a lane loads at a time: 16 bytes, except int8 rows (head_dim + 4 bytes: 4-byte aligned only).
template <typename T>
struct LoadWord {
  using type = uint4;
};
template <>
struct LoadWord<KvInt8> {
  using type = uint32_t;
};

__device__ __forceinline__ void words_of(const uint4& v, uint32_t (&w)[4]) {
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}
__device__ __forceinline__ void words_of(uint32_t v, uint32_t (&w)[1]) { w[0] = v; }

template <typename T, int N>
struct Raw {
  using Word = typename LoadWord<T>::type;
  static_assert((N * sizeof(T)) % sizeof(Word) == 0, "a lane loads whole words");
  static constexpr int kWords = int(N * sizeof(T) / sizeof(Word));
  static constexpr int kU32 = int(sizeof(Word) / 4);  // 32-bit parts of a word
  Word w[kWords];
};

template <typename T, int N>
__device__ __forceinline__ void load_raw(const T* src, Raw<T, N>& r) {
  using Word = typename Raw<T, N>::Word;
  const Word* s = reinterpret_cast<const Word*>(src);
#pragma unroll
  for (int i = 0; i < Raw<T, N>::kWords; ++i) r.w[i] = __ldg(s + i);
}

template <typename T, int N>
__device__ __forceinline__ void to_float(const Raw<T, N>& r, float (&f)[N]) {
  constexpr int kU32 = Raw<T, N>::kU32;
#pragma unroll
  for (int i = 0; i < Raw<T, N>::kWords; ++i) {
    uint32_t w[kU32];
    words_of(r.w[i], w);
#pragma unroll
    for (int j = 0; j < kU32; ++j) Cvt<T>::unpack(w[j], &f[(i * kU32 + j) * Cvt<T>::kPerWord]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void load_f(const T* src, float (&f)[N]) {
  Raw<T, N> r;
  load_raw<T, N>(src, r);
  to_float<T, N>(r, f);
}

// Weight of a partial state with max m once the common max is mn (an empty state weighs nothing; this
// also avoids (-inf) - (-inf) = NaN).
__device__ __forceinline__ float rescale(float m, float mn) { return m == -INFINITY ? 0.0f : exp2f(m - mn); }

__device__ __forceinline__ int clamp_len(const DecodeParams& p, int b) {
  return min(max(p.lengths[b], 0), p.max_tokens);
}

// Lanes that cooperate on one token: the largest power of two <= 32 that gives every lane whole 16-byte
// vectors of both the K row (D elements) and the V row (DV).
template <typename T, int D, int DV>
constexpr int lanes_per_token() {
  constexpr int kVec = 16 / int(sizeof(T));  // elements in 16 bytes
  int lpt = 32;
  while (lpt > 1 && ((D / kVec) % lpt != 0 || (DV / kVec) % lpt != 0)) lpt /= 2;
  return lpt;
}

// Per-tensor factor of an fp8 format's values (e4m3 decodes to 2^-8 of its value, see e4m3_to_float_2m8);
// 1 for the other types.
template <typename KT>
__device__ __forceinline__ float fp8_factor(float scale) {
  if constexpr (std::is_same<KT, KvE4M3>::value) return scale * 256.0f;
  if constexpr (std::is_same<KT, KvE5M2>::value) return scale;
  return 1.0f;
}

// T: type of q and out; KT: of K and V (T, or a 1-byte format with T = float).
template <typename T, typename KT, int D, int DV, int GT>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(const DecodeParams p, int num_splits, int split_tokens, float* part_acc, float* part_ml) {
  constexpr bool kRowScale = std::is_same<KT, KvInt8>::value;  // a float32 scale after each row
  constexpr int kVec = 16 / int(sizeof(KT));
  constexpr int LPT = lanes_per_token<KT, D, DV>();
  constexpr int EPL = D / LPT;    // K elements per lane
  constexpr int EPLV = DV / LPT;  // V elements per lane
  constexpr int TPW = 32 / LPT;   // tokens per warp step
  static_assert(D % (LPT * kVec) == 0 && DV % (LPT * kVec) == 0 && 32 % LPT == 0,
                "head dims must split evenly over a lane group");

  const int b = blockIdx.z;
  const int split = blockIdx.x;
  const int h0 = blockIdx.y * GT;
  const int G = p.num_heads / p.num_kv_heads;
  const int kh = h0 / G;
  const int len = clamp_len(p, b);
  const int64_t t0 = int64_t(split) * split_tokens;
  if (split > 0 && t0 >= len) return;  // nothing here (piece 0 always writes: an empty sequence gives zeros)
  const int t1 = int(min(int64_t(len), t0 + split_tokens));

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane / LPT, lig = lane % LPT;

  float q[GT][EPL], acc[GT][EPLV], m[GT], l[GT];
  const T* qp = static_cast<const T*>(p.q) + (int64_t(b) * p.num_heads + h0) * D + lig * EPL;
  const float q_factor = p.scale * kLog2e * fp8_factor<KT>(p.k_scale);
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    load_f<T, EPL>(qp + g * D, q[g]);
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      q[g][e] *= q_factor;
    }
#pragma unroll
    for (int e = 0; e < EPLV; ++e) acc[g][e] = 0.0f;
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }

  // p is resolved (decode_cuda): every V stride is spelled out.
  const KT* K0 = static_cast<const KT*>(p.k) + int64_t(kh) * p.head_stride;  // row starts (int8: scale at + D)
  const KT* V0 = static_cast<const KT*>(p.v) + int64_t(kh) * p.v_head_stride;
  const KT* K = K0 + lig * EPL;
  const KT* V = V0 + lig * EPLV;
  // int8: the float32 scale after token t's row (4-byte aligned: rows are, and D is a multiple of 16).
  auto row_scale = [](const KT* row, int dim) {
    return __ldg(reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(row) + dim));
  };
  const int64_t slot_base = p.paged ? 0 : int64_t(p.slots[b]) * p.slot_stride;
  const int64_t v_slot_base = p.paged ? 0 : int64_t(p.slots[b]) * p.v_slot_stride;
  const int32_t* bt = p.paged ? p.block_tables + int64_t(b) * p.bt_stride : nullptr;
  const int shift = p.paged ? __ffs(p.block_size) - 1 : 0;

  // Element offsets of token t's K and V rows (clamped to the piece's last token: loads never need a
  // branch, and a clamped token's score is masked instead).
  auto token_off = [&](int t, int64_t& k_off, int64_t& v_off) {
    t = min(t, t1 - 1);
    if (p.paged) {
      int32_t blk = bt[t >> shift];
      blk = min(max(blk, 0), p.num_blocks - 1);  // never read outside the pool
      const int64_t r = (int64_t(blk) << shift) + (t & (p.block_size - 1));
      k_off = r * p.token_stride;
      v_off = r * p.v_token_stride;
      return;
    }
    k_off = slot_base + int64_t(t) * p.token_stride;
    v_off = v_slot_base + int64_t(t) * p.v_token_stride;
  };

  // Software pipeline: the next step's K and V rows are loaded (raw) before this step's arithmetic, so each
  // lane keeps two tokens' loads in flight through the dot products, shuffles and exponentials (HBM
  // latency, not arithmetic, bounds a decode step). The loop bound is uniform across the warp (base, not
  // t) so that every lane reaches the shuffles.
  constexpr int kStep = kWarps * TPW;
  int base = int(t0) + warp * TPW;
  Raw<KT, EPL> k_next;
  Raw<KT, EPLV> v_next;
  float ks_next = 1.0f, vs_next = 1.0f;  // int8 row scales
  if (base < t1) {
    int64_t ko, vo;
    token_off(base + grp, ko, vo);
    load_raw<KT, EPL>(K + ko, k_next);
    load_raw<KT, EPLV>(V + vo, v_next);
    if constexpr (kRowScale) {
      ks_next = row_scale(K0 + ko, D);
      vs_next = row_scale(V0 + vo, DV);
    }
  }
  for (; base < t1; base += kStep) {
    const int t = base + grp;
    const bool valid = t < t1;
    float k[EPL], v[EPLV];
    to_float<KT, EPL>(k_next, k);
    to_float<KT, EPLV>(v_next, v);
    const float ks = ks_next, vs = vs_next;
    if (base + kStep < t1) {
      int64_t ko, vo;
      token_off(base + kStep + grp, ko, vo);
      load_raw<KT, EPL>(K + ko, k_next);
      load_raw<KT, EPLV>(V + vo, v_next);
      if constexpr (kRowScale) {
        ks_next = row_scale(K0 + ko, D);
        vs_next = row_scale(V0 + vo, DV);
      }
    }
    float s[GT];
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float x = 0.0f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) x += q[g][e] * k[e];
#pragma unroll
      for (int o = LPT / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);  // stays in the group
      s[g] = kRowScale ? x * ks : x;
    }
    if (valid) {
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        const float mn = fmaxf(m[g], s[g]);
        // m = -inf at the first token: a = 0. The rescale is skipped (a = 1) unless the max grew.
        const float a = mn == m[g] ? 1.0f : exp2f(m[g] - mn);
        const float pr = exp2f(s[g] - mn);
        l[g] = l[g] * a + pr;
        const float pv = kRowScale ? pr * vs : pr;  // int8: the row's scale goes with its probability
#pragma unroll
        for (int e = 0; e < EPLV; ++e) acc[g][e] = fmaf(pv, v[e], acc[g][e] * a);
        m[g] = mn;
      }
    }
  }

  // Merge the warp's token groups (lanes with the same slice of head_dim are `o` apart).
#pragma unroll
  for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float mn = fmaxf(m[g], mo);
      const float a = rescale(m[g], mn), ao = rescale(mo, mn);
      l[g] = l[g] * a + lo * ao;
#pragma unroll
      for (int e = 0; e < EPLV; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
        acc[g][e] = acc[g][e] * a + other * ao;
      }
      m[g] = mn;
    }
  }

  // Merge the warps.
  __shared__ float sm_m[kWarps][GT], sm_l[kWarps][GT];
  __shared__ float sm_acc[kWarps][GT][DV];
  if (grp == 0) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      if (lig == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
#pragma unroll
      for (int e = 0; e < EPLV; ++e) sm_acc[warp][g][lig * EPLV + e] = acc[g][e];
    }
  }
  __syncthreads();
  const float v_factor = fp8_factor<KT>(p.v_scale);  // fp8: v_scale applies to the whole output
  for (int i = threadIdx.x; i < GT * DV; i += kThreads) {
    const int g = i / DV, d = i % DV;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][g]);
    float L = 0.0f, A = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = rescale(sm_m[w][g], M);
      L += f * sm_l[w][g];
      A += f * sm_acc[w][g][d];
    }
    A *= v_factor;
    const int64_t bh = int64_t(b) * p.num_heads + h0 + g;
    if (num_splits == 1) {
      static_cast<T*>(p.out)[bh * DV + d] = Cvt<T>::store(L > 0.0f ? A / L : 0.0f);
    } else {
      const int64_t idx = bh * num_splits + split;
      part_acc[idx * DV + d] = A;
      if (d == 0) {
        part_ml[idx * 2] = M;
        part_ml[idx * 2 + 1] = L;
      }
    }
  }
}

__device__ float block_reduce(float x, bool is_max, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < kWarps; ++w) x = is_max ? fmaxf(x, scratch[w]) : x + scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return x;
}

// One block per (sequence, head): combine the pieces' partial results into the output.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    merge_kernel(const DecodeParams p, int num_splits, int split_tokens, const float* part_acc, const float* part_ml) {
  extern __shared__ float weight[];  // [num_splits]
  __shared__ float scratch[kWarps];
  const int64_t bh = blockIdx.x;
  const int b = int(bh / p.num_heads);
  const int len = clamp_len(p, b);
  const int n = max(1, min(num_splits, (len + split_tokens - 1) / split_tokens));
  const float* ml = part_ml + bh * num_splits * 2;

  float mx = -INFINITY;
  for (int s = threadIdx.x; s < n; s += kThreads) mx = fmaxf(mx, ml[2 * s]);
  mx = block_reduce(mx, true, scratch);
  float sum = 0.0f;
  for (int s = threadIdx.x; s < n; s += kThreads) {
    const float w = rescale(ml[2 * s], mx);
    weight[s] = w;
    sum += w * ml[2 * s + 1];
  }
  sum = block_reduce(sum, false, scratch);  // its barrier also publishes weight[]
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const int D = p.v_head_dim;
  const float* acc = part_acc + bh * num_splits * D;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float a = 0.0f;
    for (int s = 0; s < n; ++s) a += weight[s] * acc[int64_t(s) * D + d];
    static_cast<T*>(p.out)[bh * D + d] = Cvt<T>::store(a * inv);
  }
}

template <typename T, typename KT, int D, int DV, int GT>
void launch_gt(const DecodeParams& p, const CudaLaunch& L, cudaStream_t stream) {
  const dim3 grid(L.num_splits, p.num_heads / GT, p.num_seqs);
  decode_kernel<T, KT, D, DV, GT>
      <<<grid, kThreads, 0, stream>>>(p, L.num_splits, L.split_tokens, L.partial_acc, L.partial_ml);
}

template <typename T, typename KT, int D, int DV>
void launch(const DecodeParams& p, const CudaLaunch& L, cudaStream_t stream) {
  // Heads per block: as many of the G sharing a kv head as divide G, but at most 32 accumulator (and
  // query) floats per lane (GT * EPL): beyond that registers (~250 for GT = 8, EPL = 8) cap occupancy at 2
  // blocks per SM, and a second block re-reading the same K/V from L2 is cheaper.
  constexpr int LPT = lanes_per_token<KT, D, DV>();
  constexpr int EPL = (D > DV ? D : DV) / LPT;
  constexpr int kMaxGT = 32 / EPL < 1 ? 1 : 32 / EPL < 8 ? 32 / EPL : 8;
  const int G = p.num_heads / p.num_kv_heads;
  int gt = 1;
  while (gt * 2 <= kMaxGT && G % (gt * 2) == 0) gt *= 2;
  switch (gt) {
    case 8:
      if constexpr (kMaxGT >= 8) launch_gt<T, KT, D, DV, 8>(p, L, stream);
      break;
    case 4:
      if constexpr (kMaxGT >= 4) launch_gt<T, KT, D, DV, 4>(p, L, stream);
      break;
    case 2:
      if constexpr (kMaxGT >= 2) launch_gt<T, KT, D, DV, 2>(p, L, stream);
      break;
    default:
      launch_gt<T, KT, D, DV, 1>(p, L, stream);
  }
  check_cuda(cudaGetLastError(), "decode attention kernel launch");
  if (L.num_splits > 1) {
    merge_kernel<T><<<p.num_seqs * p.num_heads, kThreads, L.num_splits * sizeof(float), stream>>>(
        p, L.num_splits, L.split_tokens, L.partial_acc, L.partial_ml);
    check_cuda(cudaGetLastError(), "decode attention merge kernel launch");
  }
}

// The (head_dim, v_head_dim) pairs compiled for CUDA.
bool cuda_dims_supported(int D, int DV) {
  return (D == DV && (D == 64 || D == 128 || D == 256)) || (D == 192 && DV == 128);
}

template <typename T, typename KT = T>
void launch_dim(const DecodeParams& p, const CudaLaunch& L, cudaStream_t stream) {
  if (p.head_dim == 192) return launch<T, KT, 192, 128>(p, L, stream);
  switch (p.head_dim) {
    case 64:
      return launch<T, KT, 64, 64>(p, L, stream);
    case 128:
      return launch<T, KT, 128, 128>(p, L, stream);
    default:
      return launch<T, KT, 256, 256>(p, L, stream);
  }
}

}  // namespace

bool kernels_built_with_cuda() { return true; }

void decode_cuda(const DecodeParams& params, const CudaLaunch& L) {
  check_params(params);
  const DecodeParams p = resolve_params(params);
  auto fail = [](const std::string& m) { throw InvalidArgument("CUDA decode attention: " + m); };
  if (!cuda_dims_supported(p.head_dim, p.v_head_dim))
    fail("head_dim / v_head_dim must be 64/64, 128/128, 256/256 or 192/128, got " + std::to_string(p.head_dim) + "/" +
         std::to_string(p.v_head_dim));
  if (p.num_seqs > 65535) fail("at most 65535 sequences per launch");
  if (L.num_splits < 1 || L.num_splits > kMaxSplits) fail("num_splits must be in 1.." + std::to_string(kMaxSplits));
  if (L.split_tokens < 1) fail("split_tokens must be positive");
  if (L.num_splits > 1 && (!L.partial_acc || !L.partial_ml)) fail("split launch without partial buffers");
  if (int64_t(L.num_splits) * L.split_tokens < p.max_tokens) fail("splits do not cover max_tokens");
  const int64_t item = p.kv_dtype == kFloat32 ? 4 : is_quantized(p.kv_dtype) ? 1 : 2;
  // Lanes load 16-byte vectors (int8 K/V: 4-byte words, their rows being head_dim + 4 bytes): every row must
  // start on such a boundary; q and out rows always on 16 bytes.
  const int64_t kv_align = p.kv_dtype == kInt8 ? 4 : 16;
  const bool aligned =
      (reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.out)) % 16 == 0 &&
      (reinterpret_cast<uintptr_t>(p.k) | reinterpret_cast<uintptr_t>(p.v)) % kv_align == 0 &&
      (p.token_stride * item) % kv_align == 0 && (p.head_stride * item) % kv_align == 0 &&
      (p.v_token_stride * item) % kv_align == 0 && (p.v_head_stride * item) % kv_align == 0 &&
      (p.paged || ((p.slot_stride * item) % kv_align == 0 && (p.v_slot_stride * item) % kv_align == 0));
  if (!aligned)
    fail(p.kv_dtype == kInt8 ? "q and out must be 16-byte aligned, int8 K and V rows 4-byte aligned"
                             : "q, out, K and V rows must be 16-byte aligned");
  if (p.num_seqs == 0) return;
  DeviceGuard guard(L.device);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(L.stream);
  switch (p.kv_dtype) {  // quantized K/V: q and out are float32 (check_params)
    case kInt8:
      return launch_dim<float, KvInt8>(p, L, stream);
    case kFloat8E4M3:
      return launch_dim<float, KvE4M3>(p, L, stream);
    case kFloat8E5M2:
      return launch_dim<float, KvE5M2>(p, L, stream);
    default:
      break;
  }
  switch (p.dtype) {
    case kFloat32:
      return launch_dim<float>(p, L, stream);
    case kFloat16:
      return launch_dim<__half>(p, L, stream);
    default:
      return launch_dim<__nv_bfloat16>(p, L, stream);
  }
}

}  // namespace kernels
}  // namespace vpaged
