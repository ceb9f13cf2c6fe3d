// What the CPU decode files share (decode_cpu.cpp: checks, the generic loop, dispatch; decode_cpu_avx2.cpp and
// decode_cpu_avx512.cpp: the tile loop of decode_cpu_tiles.h at 8 and 16 lanes): the work item, where a token's
// rows are, prefetches, the scalar softmax exp, the quantized formats' scale factors and how an item's result is
// written.
//
// Everything here is defined before any file switches its ISA on (`#pragma GCC target`), so every file compiles
// the same baseline code for it: an inline function the linker merges across the files is then the same
// function, whatever ISA the file it came from was built for.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu_math.h"
#include "kernels/decode.h"

namespace vpaged {
namespace kernels {
namespace cpu_decode {

constexpr int kChunk = 32;      // tokens per online-softmax step
constexpr int kMinSplit = 256;  // fewest tokens worth a separate item (merging costs ~ one head_dim pass)
constexpr int kAhead = 16;      // tokens of prefetch distance (4 was too close; 8..48 measured alike)

// e^x for x <= 0 in the softmax, vectorisable: 2^n by exponent bits, e^r (|r| <= ln2/2) by its Taylor
// series to r^6 (relative error < 2e-7). ln2 is split in two (Cody-Waite) so that r stays exact for large
// |x|. Below -87 the result would leave the normal floats; it is ~1e-38 there, i.e. nothing, so x is
// clamped (a plain select, which GCC if-converts; a two-sided clamp would not vectorise without -ffast-math).
VP_INLINE float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest integer
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float e = 1.0f / 720.0f;
  e = e * r + 1.0f / 120.0f;
  e = e * r + 1.0f / 24.0f;
  e = e * r + 1.0f / 6.0f;
  e = e * r + 0.5f;
  e = e * r + 1.0f;
  e = e * r + 1.0f;
  return e * bits_f(uint32_t(int32_t(n) + 127) << 23);
}

// Prefetch the lines of [p, p + bytes) into L2 (locality hint 2 = prefetcht1: L2 tracks more outstanding misses than
// L1).
VP_INLINE void prefetch_span(const uint8_t* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); a < end; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
}

// Prefetch token rows at byte offsets k_off / v_off: all HKV heads when they are dense (head stride ==
// footprint), else each head's footprint. All in bytes.
VP_INLINE void prefetch_token(const uint8_t* K, const uint8_t* V, int64_t k_off, int64_t v_off, int HKV, int64_t HS,
                              int64_t VHS, int k_foot, int v_foot) {
  if (HS == k_foot) {
    prefetch_span(K + k_off, HKV * HS);
  } else {
    for (int kh = 0; kh < HKV; ++kh) prefetch_span(K + k_off + kh * HS, k_foot);
  }
  if (VHS == v_foot) {
    prefetch_span(V + v_off, HKV * VHS);
  } else {
    for (int kh = 0; kh < HKV; ++kh) prefetch_span(V + v_off + kh * VHS, v_foot);
  }
}

// The lines of the K and V rows (all kv heads) of up to kChunk tokens further on, prefetched `per` lines a step
// (issue()) so that they go out evenly over the steps of the chunk under way: K rows of every token first, then V. A
// token's heads are one span where they are dense (head stride == footprint), else a span per head. Asked for a
// token or a token pair at a time (17-256 lines at once), the prefetches came in bursts, and from memory a call took
// about the sum of its compute and memory times; spread, they overlap better (the burst filling the core's miss
// buffers is the likely reason; the VM it was measured on has no counters to show it).
struct LineWalk {
  const uint8_t* base[2];  // K, V
  const int64_t* off[2];   // per token of the next chunk: byte offset of its head-0 row, or -1 (none)
  int64_t head_stride[2];  // bytes
  int64_t footprint[2];    // bytes of one head's row
  int heads;               // kv heads
  int which = 2, tok = 0, head = 0, n = 0, per = 0;
  uintptr_t a = 0, end = 0;  // the span under way: next line, end

  VP_INLINE bool dense(int w) const { return head_stride[w] == footprint[w]; }

  // Walk the n tokens of off[] in about `steps` calls of issue().
  VP_INLINE void start(int tokens, int steps) {
    n = tokens;
    which = 0;
    tok = -1;
    head = heads;
    a = end = 0;
    int count = 0;
    for (int j = 0; j < n; ++j) count += off[0][j] >= 0;
    int64_t lines = 0;  // an upper bound: a span's whole lines, plus its partial last one and its start inside a line
    for (int w = 0; w < 2; ++w) lines += dense(w) ? heads * footprint[w] / 64 + 2 : heads * (footprint[w] / 64 + 2);
    lines *= count;
    per = steps > 0 ? int((lines + steps - 1) / steps) : 0;
  }

  // The next span into [a, end); false when the walk is over.
  VP_INLINE bool advance() {
    for (;;) {
      if (which >= 2) return false;
      if (++head >= (dense(which) ? 1 : heads)) {
        head = 0;
        if (++tok >= n) {
          ++which;
          tok = -1;
          head = heads;
          continue;
        }
      }
      const int64_t o = off[which][tok];
      if (o < 0) {
        head = heads;  // none of its heads
        continue;
      }
      const uint8_t* p = base[which] + o + head * head_stride[which];
      a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63);
      end = reinterpret_cast<uintptr_t>(p) + uintptr_t(dense(which) ? heads * footprint[which] : footprint[which]);
      return true;
    }
  }

  VP_INLINE void issue() {
    for (int k = 0; k < per; ++k) {
      if (a >= end && !advance()) return;
      __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
      a += 64;
    }
  }
};

// ------------------------------------------------------------------------------------ quantized K/V
// fp8 goes through fp16 bits: an e5m2 byte is the high byte of an fp16; the 7 low bits of an e4m3 byte shifted
// up by 7 are an fp16 of 2^-8 times its value (normal and subnormal alike, both exponents' extra bias being 8),
// so e4m3 rows take scale * 2^8 (tensor_factor).
VP_INLINE float quant_value(int kt, uint32_t b) {
  if (kt == kInt8) return float(int8_t(uint8_t(b)));
  if (kt == kFloat8E5M2) return f16_to_f32(b << 8);
  return f16_to_f32(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));  // e4m3: 2^-8 of its value
}

// What every element of a row is multiplied by: the int8 row's own scale, or the per-tensor one (e4m3: * 2^8).
template <int KT>
VP_INLINE float row_factor(const uint8_t* row, int dim, float tensor_factor) {
  if constexpr (KT == kInt8) {
    float s;
    std::memcpy(&s, row + dim, 4);  // right after the row's values, not necessarily 4-byte aligned
    return s;
  } else {
    return tensor_factor;
  }
}

template <int KT>
VP_INLINE float tensor_factor(float scale) {
  return KT == kFloat8E4M3 ? scale * 256.0f : scale;
}

// ------------------------------------------------------------------------------------ items
struct Item {
  int b;
  int t0, t1;       // tokens [t0, t1) of sequence b
  int64_t partial;  // index of its partial result, or -1: the item covers the whole sequence
};

// One item's run: parameters (resolved), the item, a thread's workspace (workspace_floats), the partial results.
using ItemFn = void (*)(const DecodeParams&, const Item&, float*, float*, float*);

// Where token t's K row and V row start (elements from k / v; parameters resolved).
struct RowFinder {
  const DecodeParams& p;
  int b;
  int64_t slot_base = 0, v_slot_base = 0;
  int shift = 0;
  RowFinder(const DecodeParams& params, int seq) : p(params), b(seq) {
    if (p.paged) {
      while ((1 << shift) < p.block_size) ++shift;
    } else {
      slot_base = int64_t(p.slots[b]) * p.slot_stride;
      v_slot_base = int64_t(p.slots[b]) * p.v_slot_stride;
    }
  }
  VP_INLINE void operator()(int t, int64_t& k_off, int64_t& v_off) const {
    if (!p.paged) {
      k_off = slot_base + int64_t(t) * p.token_stride;
      v_off = v_slot_base + int64_t(t) * p.v_token_stride;
      return;
    }
    int32_t blk = p.block_tables[int64_t(b) * p.bt_stride + (t >> shift)];
    blk = blk < 0 ? 0 : (blk >= p.num_blocks ? p.num_blocks - 1 : blk);  // never read outside the pool
    const int64_t r = (int64_t(blk) << shift) + (t & (p.block_size - 1));
    k_off = r * p.token_stride;
    v_off = r * p.v_token_stride;
  }
};

// Prefetch the K and V rows of tokens [t0, t1) at once (elem_bytes a stored element; strides and footprints in
// bytes): an item's first rows, asked for together so that they arrive in parallel instead of as one demand miss
// after another.
VP_INLINE void prefetch_rows(const RowFinder& row, int t0, int t1, int64_t elem_bytes, const uint8_t* K,
                             const uint8_t* V, int HKV, int64_t HS, int64_t VHS, int k_foot, int v_foot) {
  for (int t = t0; t < t1; ++t) {
    int64_t ko, vo;
    row(t, ko, vo);
    prefetch_token(K, V, ko * elem_bytes, vo * elem_bytes, HKV, HS, VHS, k_foot, v_foot);
  }
}

// The byte offsets of the K and V rows of the n tokens from `first` on (elem_bytes a stored element), -1 from t1 on:
// the rows a prefetch walk (LineWalk) asks for.
VP_INLINE void rows_ahead(const RowFinder& row, int first, int t1, int n, int64_t elem_bytes, int64_t* k_off,
                          int64_t* v_off) {
  for (int i = 0; i < n; ++i) {
    if (first + i < t1) {
      row(first + i, k_off[i], v_off[i]);
      k_off[i] *= elem_bytes;
      v_off[i] *= elem_bytes;
    } else {
      k_off[i] = v_off[i] = -1;
    }
  }
}

// Floats of per-thread workspace an item needs (the tile loops' partial score vectors, 4 heads x kChunk
// tokens x up to 16 lanes, fit in the kChunk rows of max(D, DV, 64) floats).
// floats of per-head query facts the int8 dot-product scores keep (the query's scale and its sum, 2 * H).
inline size_t workspace_floats(const DecodeParams& p) {
  const size_t H = p.num_heads, D = p.head_dim, DV = p.v_head_dim;
  return H * D + H * DV + size_t(kChunk) * std::max<size_t>(std::max<size_t>(D, DV), 64) + H * kChunk + 4 * H;
}

// Write an item's result: the normalised output when it covers its whole sequence, else its partial state.
template <int DT>
VP_INLINE void finish_item(const DecodeParams& p, const Item& it, const float* acc, const float* m, const float* l,
                           float* part_acc, float* part_ml) {
  using T = typename Elem<DT>::T;
  const int H = p.num_heads, D = p.v_head_dim;
  if (it.partial < 0) {
    T* out = static_cast<T*>(p.out) + int64_t(it.b) * H * D;
    for (int h = 0; h < H; ++h) {
      const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // an empty sequence attends to nothing: zeros
      for (int d = 0; d < D; ++d) out[h * D + d] = Elem<DT>::store(acc[h * D + d] * inv);
    }
  } else {
    std::memcpy(part_acc + it.partial * H * D, acc, sizeof(float) * H * D);
    for (int h = 0; h < H; ++h) {
      part_ml[(it.partial * H + h) * 2] = m[h];
      part_ml[(it.partial * H + h) * 2 + 1] = l[h];
    }
  }
}

// The tile loop's item function for (q/out dtype, K/V format, head dims) on one ISA, or nullptr where it is not
// compiled (head dims other than 64/64, 128/128, 256/256 and 192/128; AVX2: 16-bit and 1-byte K/V only, the
// 1-byte ones with dtype kFloat32, int8 by 16-bit integer products; AVX-512: fp32 and 16-bit K/V, bf16_dot for bf16
// scores by vdpbf16ps, and the 1-byte formats, int8_dot for int8 scores by vpdpbusd of a query quantized per head:
// decode_cpu_tiles.h). Call only where the CPU has the ISA (decode_cpu.cpp checks; int8_dot needs AVX512_VNNI).
ItemFn avx2_tile_item(int dtype, int kv_dtype, int D, int DV);
ItemFn avx512_tile_item(int dtype, int kv_dtype, int D, int DV, bool bf16_dot, bool int8_dot = false);
// The AMX item function for these parameters (resolved), or nullptr where decode_cpu_amx.cpp does not cover them (it
// takes bf16 q/K/V/out, contiguous K/V, 4 <= G <= 16 and the tile loop's head dims). Call only where cpu_has_amx().
ItemFn amx_item(const DecodeParams& p);

}  // namespace cpu_decode
}  // namespace kernels
}  // namespace vpaged
