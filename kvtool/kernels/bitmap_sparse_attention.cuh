// Bitmap decode attention, layout v2 (kvtool/kernels/bitmap_layout.py), CUDA backend of
// kvtool/kernels/bitmap_sparse_attention.py. Work follows the stored elements: every thread walks
// the set bits of its bitmap words and, per stored element, fetches the dense operand at that
// position from shared memory (keys: the query rows at the element's channel; values: the
// probabilities at the element's token), so no dense tile of the cache is ever built.
//
// One program = (KV head bh, split, chunk of NR query rows), 128 threads. It walks its layout
// blocks two at a time (128 tokens): cp.async stages the pair's bitmaps and packed elements into
// one shared-memory buffer as two load groups, keys and values; each half of the next pair is
// requested as soon as this pair is done with that half, so loads overlap the other half's work
// without a second buffer (two buffers halve the programs per SM and were slower), then
//   keys   (token tiles, bits along channels): thread = token; score[r] += val * q[r][channel];
//   softmax (one warp per row) turns the 128 scores into probabilities and rescales;
//   values (channel tiles, bits along tokens): thread = channel; acc[r] += val * p[r][token].
// A thread's run in the staged block starts at the exclusive prefix sum of the popcounts in
// storage order (a block-wide scan of two 16-bit counts packed in one int: both blocks at once).
// Program split == S attends the dense window. Partials (acc, m, l; base-2 scores) are merged
// by kvtool's Triton merge kernel.
// Bound (docs/benchmarks.md): instruction issue and the shared-memory pipe together (the gathers
// land on random banks), not DRAM bytes.
// Progress (both walks): every __syncthreads() is reached by all 128 threads the same number of
// times, since the loops around them run over bounds that are uniform in the program (b0, b1, W
// and the lengths come from blockIdx and Params, read by every thread alike) and no barrier sits
// under a thread-dependent branch; the cp.async waits wait on a thread's own load groups, which are
// committed by every thread in the same order (empty groups included), so "all but the newest
// group" names the same half in every thread. The tensor-core walk (bitmap_sparse_attention_mma.cuh)
// shares the stage layout, the scans and the split layout; in long launches on sm_90 it stages
// with bulk copies instead.

#pragma once
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <stdint.h>
#include <type_traits>

namespace bsa {

constexpr int THREADS = 128;

inline void check(cudaError_t e) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("bitmap_sparse_attention: ") + cudaGetErrorString(e));
}
constexpr int PAIR = 128;  // tokens per step: two 64-token layout blocks

__device__ __forceinline__ float to_f(half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(float x) { return x; }

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void cp_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

// Exclusive block-wide prefix sum of x (THREADS threads), total in *total.
__device__ __forceinline__ int block_excl_scan(int x, int* scratch, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inc = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  int base = 0, tot = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) {
    int s = scratch[w];
    base += w < warp ? s : 0;
    tot += s;
  }
  __syncthreads();
  *total = tot;
  return base + inc - x;
}

__device__ __forceinline__ void store_tab(float* t, float x) { *t = x; }
__device__ __forceinline__ void store_tab(half* t, float x) { *t = __float2half_rn(x); }

// acc[r] += v * src[r], r < NR, src a table row of NR floats or halves (one vector load).
template <int NR>
__device__ __forceinline__ void fma_rows(float* acc, float v, const float* src) {
  if constexpr (NR % 4 == 0) {
#pragma unroll
    for (int r = 0; r < NR; r += 4) {
      float4 s = *reinterpret_cast<const float4*>(src + r);
      acc[r] += v * s.x; acc[r + 1] += v * s.y; acc[r + 2] += v * s.z; acc[r + 3] += v * s.w;
    }
  } else if constexpr (NR == 2) {
    float2 s = *reinterpret_cast<const float2*>(src);
    acc[0] += v * s.x; acc[1] += v * s.y;
  } else {
    acc[0] += v * src[0];
  }
}
template <int NR>
__device__ __forceinline__ void fma_rows(float* acc, float v, const half* src) {
  if constexpr (NR % 4 == 0) {
#pragma unroll
    for (int r = 0; r < NR; r += 4) {
      uint2 raw = *reinterpret_cast<const uint2*>(src + r);
      float2 a = __half22float2(*reinterpret_cast<half2*>(&raw.x));
      float2 b = __half22float2(*reinterpret_cast<half2*>(&raw.y));
      acc[r] += v * a.x; acc[r + 1] += v * a.y; acc[r + 2] += v * b.x; acc[r + 3] += v * b.y;
    }
  } else if constexpr (NR == 2) {
    float2 a = __half22float2(*reinterpret_cast<const half2*>(src));
    acc[0] += v * a.x; acc[1] += v * a.y;
  } else {
    acc[0] += v * __half2float(src[0]);
  }
}

// The fp16 table row of NR halves (NR >= 2) at shared address a, as NR / 2 half2 words.
template <int NR>
__device__ __forceinline__ void load_row(unsigned a, unsigned* x) {
  if constexpr (NR == 8) asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(a));
  else if constexpr (NR == 4) asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(x[0]), "=r"(x[1]) : "r"(a));
  else asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x[0]) : "r"(a));
}

// The highest set bit of w, cleared from w: bfind gives its index in one instruction (a lowest-first
// walk needs brev + clz + a subtract) and bmsk the mask of the bits below it.
__device__ __forceinline__ unsigned take_one(unsigned& w) {
  unsigned bit, below;
  asm("bfind.u32 %0, %1;" : "=r"(bit) : "r"(w));
  asm("bmsk.clamp.b32 %0, 0, %1;" : "=r"(below) : "r"(bit));
  w &= below;
  return bit;
}

// The two highest set bits of w (w != 0), cleared from w; false when w had one (then b1 = b0).
__device__ __forceinline__ bool take_two(unsigned& w, unsigned& b0, unsigned& b1) {
  b0 = take_one(w);
  const bool two = w != 0;
  b1 = take_one(w);  // bfind of 0 is 0xffffffff and bmsk clamps: w stays 0
  b1 = two ? b1 : b0;
  return two;
}

// How a word's stored elements are read and summed (half tables, NR >= 2; other tables take one
// element per iteration):
//   WALK_F32    fp32 sums, one 16-bit load per element;
//   WALK_PAIRED fp32 sums, the elements two at a time by one aligned 32-bit load (after a lone
//               first one when the run ends on an odd element): half the value loads, so fewer
//               bank conflicts on the gathers (at 50% sparsity 475 -> 403 us on the H100), for a
//               lone step per word that costs about 2% at 70%;
//   WALK_F16    as WALK_PAIRED, each word's products summed by half2 FMAs (float16 caches; bfloat16
//               ones take WALK_PAIRED) and added to the fp32 sums once per word: 2 instead of 9
//               arithmetic instructions per element.
//   WALK_MMA    the tensor-core walk of bitmap_sparse_attention_mma.cuh (head_dim 128);
//   WALK_MMA_BUFFERED  the same, reading each run through a two-word buffer (dense stages).
enum Walk { WALK_F32 = 0, WALK_PAIRED = 1, WALK_F16 = 2, WALK_MMA = 3, WALK_MMA_BUFFERED = 4 };

template <typename T>
__device__ __forceinline__ float bits_to_f(unsigned short x) {
  if constexpr (std::is_same<T, half>::value) return __half2float(__ushort_as_half(x));
  else return __bfloat162float(__ushort_as_bfloat16(x));
}
template <typename T>
__device__ __forceinline__ unsigned short f_to_bits(float x) {
  if constexpr (std::is_same<T, half>::value) return __half_as_ushort(__float2half_rn(x));
  else return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// acc[r] += v * x[r], x an fp16 table row of NR halves loaded as NR / 2 half2 words.
template <int NR>
__device__ __forceinline__ void fma_row_f32(float* acc, float v, const unsigned* x) {
#pragma unroll
  for (int i = 0; i < NR / 2; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const half2*>(&x[i]));
    acc[2 * i] += v * f.x; acc[2 * i + 1] += v * f.y;
  }
}

// acc[r] += run element * table row (bit) for each set bit of w, highest bit first: `vend` points
// one past the word's packed run and steps down (take_one / take_two). Table rows (and values,
// except in WALK_F32) are read through 32-bit shared addresses: through the generic pointer the
// compiler rebuilt them from the word's offset in three instructions. Two elements per iteration,
// both rows and values loaded before the first FMA, so a warp waits once per pair on shared-memory
// latency; an odd last element pairs with a copy of its own row and a zero value.
template <typename T, typename TAB, int NR, int WALK>
__device__ __forceinline__ void walk_word(unsigned w, const T* vend, const TAB* table, float* acc) {
  if constexpr (sizeof(TAB) == 2 && NR >= 2) {
    const unsigned base = (unsigned)__cvta_generic_to_shared(table);
    if constexpr (WALK == WALK_F32) {
      while (w) {
        unsigned b0, b1, x0[NR / 2], x1[NR / 2];
        const bool two = take_two(w, b0, b1);
        load_row<NR>(base + b0 * (NR * 2), x0);
        load_row<NR>(base + b1 * (NR * 2), x1);
        // a lone last element reads no second value: the element before the run may lie in another
        // stage region whose copy is in flight (racecheck)
        const float v0 = to_f(vend[-1]), v1 = two ? to_f(vend[-2]) : 0.f;
        vend -= 2;
        fma_row_f32<NR>(acc, v0, x0);
        fma_row_f32<NR>(acc, v1, x1);
      }
    } else {
      unsigned va = (unsigned)__cvta_generic_to_shared(vend);  // bytes, one past the run
      constexpr bool H16 = WALK == WALK_F16 && std::is_same<T, half>::value;
      half2 h[NR / 2];
#pragma unroll
      for (int i = 0; i < NR / 2; ++i) h[i] = __float2half2_rn(0.f);
      if (w && (va & 2)) {  // the run ends on an odd element: it goes alone
        unsigned x[NR / 2];
        unsigned short raw;
        const unsigned b = take_one(w);
        load_row<NR>(base + b * (NR * 2), x);
        va -= 2;
        asm volatile("ld.shared.u16 %0, [%1];" : "=h"(raw) : "r"(va));
        if constexpr (H16) {
          const half2 vh = __half2half2(__ushort_as_half(raw));
#pragma unroll
          for (int i = 0; i < NR / 2; ++i) h[i] = __hfma2(vh, *reinterpret_cast<half2*>(&x[i]), h[i]);
        } else {
          fma_row_f32<NR>(acc, bits_to_f<T>(raw), x);
        }
      }
      while (w) {
        unsigned b0, b1, x0[NR / 2], x1[NR / 2], pair;
        const bool two = take_two(w, b0, b1);
        load_row<NR>(base + b0 * (NR * 2), x0);
        load_row<NR>(base + b1 * (NR * 2), x1);
        va -= 4;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(pair) : "r"(va));  // low half: the lower element
        if constexpr (H16) {
          const half2 p2 = *reinterpret_cast<half2*>(&pair);
          const half2 v0h = __high2half2(p2);
          const half2 v1h = two ? __low2half2(p2) : __float2half2_rn(0.f);
#pragma unroll
          for (int i = 0; i < NR / 2; ++i) {
            h[i] = __hfma2(v0h, *reinterpret_cast<half2*>(&x0[i]), h[i]);
            h[i] = __hfma2(v1h, *reinterpret_cast<half2*>(&x1[i]), h[i]);
          }
        } else {
          float v0, v1;
          if constexpr (std::is_same<T, half>::value) {
            const float2 vv = __half22float2(*reinterpret_cast<half2*>(&pair));  // the convert picks the halves
            v0 = vv.y; v1 = vv.x;
          } else {
            v0 = bits_to_f<T>((unsigned short)(pair >> 16));
            v1 = bits_to_f<T>((unsigned short)(pair & 0xffffu));
          }
          fma_row_f32<NR>(acc, v0, x0);
          fma_row_f32<NR>(acc, two ? v1 : 0.f, x1);
        }
      }
      if constexpr (H16) {
#pragma unroll
        for (int i = 0; i < NR / 2; ++i) {
          const float2 f = __half22float2(h[i]);
          acc[2 * i] += f.x; acc[2 * i + 1] += f.y;
        }
      }
    }
  } else {
    while (w) {
      fma_rows<NR>(acc, to_f(*--vend), table + take_one(w) * NR);
    }
  }
}

// A key row of NH 32-bit words h[] (bit i of word j <-> channel 32 j + i), packed from `start`
// in word order, visited from word `rot` on (wrapping): lanes whose rows have equal lengths in a
// multiple of 4-byte words would otherwise read one shared-memory bank together.
template <typename T, typename TAB, int NR, int NH, int WALK>
__device__ __forceinline__ void walk_row(const unsigned* h, int rot, const T* run, int start, const TAB* table, float* acc) {
  unsigned r[NH];
  int pp[NH];
  const TAB* tb[NH];
  int pos = start;
#pragma unroll
  for (int i = 0; i < NH; ++i) {
    r[i] = h[i];
    pos += __popc(h[i]);
    pp[i] = pos;  // one past word i's run
    tb[i] = table + 32 * i * NR;
  }
#pragma unroll
  for (int k = 0; k < NH - 1; ++k) {  // rotate left by rot, one constant-index step at a time
    const bool step = k < rot;
    const unsigned r0 = r[0];
    const int p0 = pp[0];
    const TAB* t0 = tb[0];
#pragma unroll
    for (int i = 0; i < NH - 1; ++i) {
      r[i] = step ? r[i + 1] : r[i];
      pp[i] = step ? pp[i + 1] : pp[i];
      tb[i] = step ? tb[i + 1] : tb[i];
    }
    r[NH - 1] = step ? r0 : r[NH - 1];
    pp[NH - 1] = step ? p0 : pp[NH - 1];
    tb[NH - 1] = step ? t0 : tb[NH - 1];
  }
#pragma unroll
  for (int i = 0; i < NH; ++i) walk_word<T, TAB, NR, WALK>(r[i], run + pp[i], tb[i], acc);
}

// Tc, NB, W: compressed tokens, their 64-token blocks and window tokens attended; TCS, NBS, WS: the
// per-KV-head strides of the key bitmaps (token rows), of the value bitmaps and offsets (blocks)
// and of the window (token rows). A cache with room to grow (bitmap_sparse_attention.py, "Caches that
// grow") passes its capacity as strides and its valid lengths on the device (lens: compressed tokens,
// window tokens), read by every program at its start (resolve_lengths), so that a graph replays as the
// cache grows.
struct Params {
  const void* q; const uint64_t* kbm; const void* knz; const int64_t* koff;
  const uint64_t* vbm; const void* vnz; const int64_t* voff; const void* wk; const void* wv;
  float* acc; float* m; float* l; const int* lens;
  float scale_log2; int Tc, W, D, DT, NB, R, RP, DP, BPS, S, KCAP, VCAP, half_tables, walk, bits_global, bulk;
  int TCS, NBS, WS;
};

// The lengths from the device (capacity caches): at most the capacity, the blocks spread over the
// S splits in whole pairs (the host planned S for the capacity). Read once for the program and shared:
// the loops around the barriers take their bounds from them, so every thread must see the same values
// even if another stream wrote the lengths while the program ran (threads reading global memory at
// different times could disagree, and a loop bound that differs between warps deadlocks a barrier).
__device__ __forceinline__ void resolve_lengths(Params& p) {
  if (p.lens != nullptr) {  // a kernel argument: the same branch in every thread
    __shared__ int lens[2];
    if (threadIdx.x < 2) lens[threadIdx.x] = p.lens[threadIdx.x];
    __syncthreads();
    p.Tc = min(max(lens[0], 0), p.Tc);
    p.W = min(max(lens[1], 0), p.W);
    p.NB = (p.Tc + 63) / 64;
    p.BPS = 2 * (((p.NB + 1) / 2 + p.S - 1) / p.S);
  }
}

// One shared-memory stage: key bits [PAIR * DT] and value bits [2 * D] (unless bits_global: then
// threads read their words from global memory), key elements [KCAP], STAGE_GUARD bytes never
// written, value elements [VCAP]. The tensor-core walk reads whole 32-bit words around a run and up
// to 8 bytes past its end (the selectors never pick those bytes); the guard keeps those reads off
// the value elements, whose copy is in flight while the keys are walked (compute-sanitizer's
// racecheck reported the read of a word being written by the copy).
constexpr int STAGE_GUARD = 16;
template <typename T>
struct Stage {
  size_t vb, ks, vs;
  __device__ __forceinline__ explicit Stage(const Params& p) {
    vb = p.bits_global ? 0 : (size_t)PAIR * p.DT * 8;
    ks = vb + (p.bits_global ? 0 : (size_t)2 * p.D * 8);
    vs = ks + ((size_t)p.KCAP * sizeof(T) + 15) / 16 * 16 + STAGE_GUARD;
  }
};

// A pair's key part (bits unless bits_global, packed elements [e0, e1)) or value part into stage `st`.
template <typename T, bool KEYS>
__device__ __forceinline__ void stage_half(const Params& p, char* st, int64_t bh, int blk, int nblk, int64_t e0, int64_t e1) {
  const Stage<T> L(p);
  constexpr int EPV = 16 / sizeof(T);
  if (!p.bits_global) {
    if (KEYS) {
      const int tok0 = blk * 64;
      const int ntok = min(nblk * 64, p.Tc - tok0);
      uint64_t* kb = reinterpret_cast<uint64_t*>(st);
      const uint64_t* ksrc = p.kbm + ((size_t)bh * p.TCS + tok0) * p.DT;
      for (int i = threadIdx.x; i < ntok * p.DT; i += THREADS) cp8(kb + i, ksrc + i);
    } else {
      uint64_t* vb = reinterpret_cast<uint64_t*>(st + L.vb);
      const uint64_t* vsrc = p.vbm + ((size_t)bh * p.NBS + blk) * p.D;
      for (int i = threadIdx.x; i < nblk * p.D; i += THREADS) cp8(vb + i, vsrc + i);
    }
  }
  T* dst = reinterpret_cast<T*>(st + (KEYS ? L.ks : L.vs));
  const T* src = reinterpret_cast<const T*>(KEYS ? p.knz : p.vnz) + e0;
  for (int i = threadIdx.x * EPV; i < (int)(e1 - e0); i += THREADS * EPV) cp16(dst + i, src + i);
}

template <typename T, bool KEYS>
__device__ __forceinline__ void stage_half(const Params& p, char* st, int64_t bh, int blk, int nblk) {
  const int64_t* off = (KEYS ? p.koff : p.voff) + bh * p.NBS + blk;
  stage_half<T, KEYS>(p, st, bh, blk, nblk, off[0], off[nblk]);
}

// The blocks [b0, b1) of a split (none for the window program, split == S).
__device__ __forceinline__ int2 split_blocks(const Params& p, int split) {
  const int b0 = split * p.BPS;
  return make_int2(b0, split < p.S ? min(p.NB, b0 + p.BPS) : b0);
}

// The split's blocks, its first pair requested (keys, then values: two load groups) before the
// caller reads its query rows, so the waits overlap.
template <typename T>
__device__ __forceinline__ int2 stage_first_pair(const Params& p, char* st, int64_t bh, int split) {
  const int2 range = split_blocks(p, split);
  const int b0 = range.x, b1 = range.y;
  if (b0 < b1) stage_half<T, true>(p, st, bh, b0, min(2, b1 - b0));
  cp_commit();
  if (b0 < b1) stage_half<T, false>(p, st, bh, b0, min(2, b1 - b0));
  cp_commit();
  return make_int2(b0, b1);
}

// Where a thread's runs start in a pair's stage, in elements: (first block, second block), from its
// element counts in the two blocks packed as c0 + (c1 << 16), by one block-wide scan of both.
// `second`: where the second block's run starts in the stage (its offset minus the first's: the first
// run padded to 16 bytes in a packed layout, a fixed slot in a cache with room to grow).
__device__ __forceinline__ int2 pair_run_starts(int packed_counts, int* scratch, int second) {
  int total;
  const int packed = block_excl_scan(packed_counts, scratch, &total);
  return make_int2(packed & 0xffff, (packed >> 16) + second);
}

// The second block's start in a pair's stage (see pair_run_starts), keys and values; 0 for a lone block.
__device__ __forceinline__ int2 second_starts(const Params& p, int64_t bh, int blk, int nblk) {
  if (nblk < 2) return make_int2(0, 0);
  const int64_t g = bh * p.NBS + blk;
  return make_int2((int)(p.koff[g + 1] - p.koff[g]), (int)(p.voff[g + 1] - p.voff[g]));
}

// One warp per row: scores sc[t * NR + r] (base 2, -inf = masked) -> probabilities ps, running
// max / sum updated, alpha[r] = rescale factor of the old accumulator.
template <int NR, typename TAB>
__device__ __forceinline__ void softmax_step(const float* sc, TAB* ps, float* mrow, float* lrow, float* alpha) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = warp; r < NR; r += THREADS / 32) {
    float s[PAIR / 32];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < PAIR / 32; ++i) { s[i] = sc[(lane + 32 * i) * NR + r]; mx = fmaxf(mx, s[i]); }
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_old = mrow[r];
    const float m_new = fmaxf(m_old, mx);
    const float m_safe = m_new == -INFINITY ? 0.f : m_new;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < PAIR / 32; ++i) {
      float e = exp2f(s[i] - m_safe);
      store_tab(ps + (lane + 32 * i) * NR + r, e);
      sum += e;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    __syncwarp();  // every lane has read mrow[r] before lane 0 writes it (a shuffle orders no memory: racecheck)
    if (lane == 0) {
      const float a = exp2f(m_old - m_safe);
      alpha[r] = a;
      lrow[r] = lrow[r] * a + sum;
      mrow[r] = m_new;
    }
  }
}

// TAB: type of the shared-memory tables gathered per stored element (query rows, probabilities):
// half halves the gather's shared-memory wavefronts.
template <typename T, typename TAB, int NR, int CPT, int WALK>
__global__ void __launch_bounds__(THREADS) bitmap_sparse_attention_kernel(Params pin) {
  extern __shared__ __align__(16) char smem[];
  Params p = pin;
  resolve_lengths(p);
  const int64_t bh = blockIdx.x;
  const int split = blockIdx.y;
  const int r0 = blockIdx.z * NR;
  const int tid = threadIdx.x;
  float* sc = reinterpret_cast<float*>(smem);            // [PAIR][NR] scores
  float* mrow = sc + PAIR * NR;                           // [NR]
  float* lrow = mrow + NR;
  float* alpha = lrow + NR;
  int* scratch = reinterpret_cast<int*>(alpha + NR);      // [8]
  TAB* qs = reinterpret_cast<TAB*>(scratch + 8);          // [D][NR], scaled by scale * log2(e)
  TAB* ps = qs + p.D * NR;                                // [PAIR][NR] probabilities
  char* st = smem + ((size_t)(PAIR * NR + 3 * NR + 8) * 4 + (size_t)(p.D * NR + PAIR * NR) * sizeof(TAB) + 15) / 16 * 16;
  const Stage<T> L(p);

  const int2 range = stage_first_pair<T>(p, st, bh, split);
  const int b0 = range.x, b1 = range.y;
  const T* q = reinterpret_cast<const T*>(p.q);
#pragma unroll 4
  for (int i = tid; i < p.D * NR; i += THREADS) {  // unrolled: the loads in flight together
    const int c = i / NR, r = i % NR;
    store_tab(qs + i, r0 + r < p.R ? to_f(q[(bh * p.R + r0 + r) * p.D + c]) * p.scale_log2 : 0.f);
  }
  if (tid < NR) { mrow[tid] = -INFINITY; lrow[tid] = 0.f; }
  float acc[CPT][NR];
#pragma unroll
  for (int i = 0; i < CPT; ++i)
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[i][r] = 0.f;

  if (split < p.S) {
    for (int blk = b0; blk < b1; blk += 2) {
      const int nblk = min(2, b1 - blk);
      const int nnext = min(2, b1 - blk - 2);  // blocks of the next pair (<= 0: none)
      const int2 second = second_starts(p, bh, blk, nblk);
      // this pair's keys (its values may still be in flight): two groups are outstanding here, this
      // pair's keys then its values (stage_first_pair, or the two commits of the previous iteration)
      cp_wait_one();
      __syncthreads();
      const int tok0 = blk * 64;
      const uint64_t* kb = p.bits_global ? p.kbm + ((size_t)bh * p.TCS + tok0) * p.DT : reinterpret_cast<const uint64_t*>(st);
      const uint64_t* vb = p.bits_global ? p.vbm + ((size_t)bh * p.NBS + blk) * p.D : reinterpret_cast<const uint64_t*>(st + L.vb);
      const T* ks = reinterpret_cast<const T*>(st + L.ks);
      const T* vs = reinterpret_cast<const T*>(st + L.vs);
      const int ntok = min(nblk * 64, p.Tc - tok0);
      // keys: thread = token of the pair; its run starts after the earlier tokens of its block
      const bool has_tok = tid < ntok;
      constexpr int NH = 4 * CPT;  // 32-bit words per key row (head_dim <= 128 * CPT)
      unsigned h[NH];
      int cnt = 0;
#pragma unroll
      for (int i = 0; i < NH; ++i) {
        h[i] = has_tok && i < 2 * p.DT ? reinterpret_cast<const unsigned*>(kb)[tid * 2 * p.DT + i] : 0u;
        cnt += __popc(h[i]);
      }
      const int2 starts = pair_run_starts(tid < 64 ? cnt : cnt << 16, scratch, second.x);
      int pos = tid < 64 ? starts.x : starts.y;
      float s[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) s[r] = 0.f;
      // equal counts put every lane on one bank when the row stride is a multiple of 4 words
      const int rot = (cnt & 7) == 0 ? (tid & 3) % (2 * p.DT) : 0;
      walk_row<T, TAB, NR, NH, WALK>(h, rot, ks, pos, qs, s);
#pragma unroll
      for (int r = 0; r < NR; ++r) sc[tid * NR + r] = has_tok ? s[r] : -INFINITY;
      __syncthreads();
      if (nnext > 0) stage_half<T, true>(p, st, bh, blk + 2, nnext);  // key part free: next keys
      cp_commit();
      softmax_step<NR>(sc, ps, mrow, lrow, alpha);
      cp_wait_one();  // this pair's values (the next keys, committed just above, may still be in flight)
      __syncthreads();
      // values: thread = CPT channels; run = after the earlier channels of the same block
      int vc = 0;
      uint64_t w0[CPT], w1[CPT];
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
        const int c = tid * CPT + i;
        w0[i] = c < p.D ? vb[c] : 0;
        w1[i] = c < p.D && nblk > 1 ? vb[p.D + c] : 0;
        vc += __popcll(w0[i]) + (__popcll(w1[i]) << 16);
      }
      const int2 vstarts = pair_run_starts(vc, scratch, second.y);
      int p0 = vstarts.x, p1 = vstarts.y;
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[i][r] *= alpha[r];
        const unsigned lo0 = (unsigned)w0[i], lo1 = (unsigned)w1[i];
        const int e0 = p0 + __popc(lo0), e1 = p1 + __popc(lo1);
        p0 += __popcll(w0[i]);
        p1 += __popcll(w1[i]);
        walk_word<T, TAB, NR, WALK>(lo0, vs + e0, ps, acc[i]);
        walk_word<T, TAB, NR, WALK>((unsigned)(w0[i] >> 32), vs + p0, ps + 32 * NR, acc[i]);
        walk_word<T, TAB, NR, WALK>(lo1, vs + e1, ps + 64 * NR, acc[i]);
        walk_word<T, TAB, NR, WALK>((unsigned)(w1[i] >> 32), vs + p1, ps + 96 * NR, acc[i]);
      }
      __syncthreads();
      if (nnext > 0) stage_half<T, false>(p, st, bh, blk + 2, nnext);
      cp_commit();
    }
    cp_wait_all();  // the last pair committed empty groups: nothing is left in flight at exit
  } else {
    const T* wk = reinterpret_cast<const T*>(p.wk);
    const T* wv = reinterpret_cast<const T*>(p.wv);
    __syncthreads();
    for (int w0 = 0; w0 < p.W; w0 += PAIR) {
      const int t = w0 + tid;
      float s[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) s[r] = 0.f;
      if (t < p.W) {
        const T* row = wk + ((size_t)bh * p.WS + t) * p.D;
        if ((p.D & 7) == 0) {
          // 16-byte loads, eight in flight per 64 channels: a thread reads its own token's row, and
          // one element at a time kept a load in flight per channel (the window program was the
          // slowest of a short launch)
          for (int c0 = 0; c0 < p.D; c0 += 64) {
            uint4 x[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) x[k] = c0 + 8 * k < p.D ? reinterpret_cast<const uint4*>(row + c0)[k] : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              const T* e = reinterpret_cast<const T*>(&x[k]);
#pragma unroll
              for (int j = 0; j < 8; ++j)
                if (c0 + 8 * k + j < p.D) fma_rows<NR>(s, to_f(e[j]), qs + (c0 + 8 * k + j) * NR);
            }
          }
        } else {
          for (int c = 0; c < p.D; ++c) fma_rows<NR>(s, to_f(row[c]), qs + c * NR);
        }
      }
#pragma unroll
      for (int r = 0; r < NR; ++r) sc[tid * NR + r] = t < p.W ? s[r] : -INFINITY;
      __syncthreads();
      softmax_step<NR>(sc, ps, mrow, lrow, alpha);
      __syncthreads();
      const int n = min(PAIR, p.W - w0);
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
        const int c = tid * CPT + i;
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[i][r] *= alpha[r];
        if (c < p.D) {
#pragma unroll 8
          for (int j = 0; j < n; ++j) fma_rows<NR>(acc[i], to_f(wv[((size_t)bh * p.WS + w0 + j) * p.D + c]), ps + j * NR);
        }
      }
      __syncthreads();
    }
  }
  __syncthreads();
  const int64_t slot = bh * (p.S + 1) + split;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = tid * CPT + i;
    if (c < p.D)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (r0 + r < p.R) p.acc[(slot * p.RP + r0 + r) * p.DP + c] = acc[i][r];
  }
  if (tid < NR && r0 + tid < p.R) {
    p.m[slot * p.RP + r0 + tid] = mrow[tid];
    p.l[slot * p.RP + r0 + tid] = lrow[tid];
  }
}

template <typename T, int NR, int CPT>
void launch(const Params& p, dim3 grid, size_t smem, cudaStream_t stream) {
  auto kern = !p.half_tables ? bitmap_sparse_attention_kernel<T, float, NR, CPT, WALK_F32>
             : p.walk == WALK_F16 ? bitmap_sparse_attention_kernel<T, half, NR, CPT, WALK_F16>
             : p.walk == WALK_PAIRED ? bitmap_sparse_attention_kernel<T, half, NR, CPT, WALK_PAIRED>
                                     : bitmap_sparse_attention_kernel<T, half, NR, CPT, WALK_F32>;
  if (smem > 48 * 1024) check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kern<<<grid, THREADS, smem, stream>>>(p);
  check(cudaGetLastError());
}

template <typename T, int CPT>
void dispatch_nr(const Params& p, int nr, dim3 grid, size_t smem, cudaStream_t s) {
  switch (nr) {
    case 1: launch<T, 1, CPT>(p, grid, smem, s); break;
    case 2: launch<T, 2, CPT>(p, grid, smem, s); break;
    case 4: launch<T, 4, CPT>(p, grid, smem, s); break;
    default: launch<T, 8, CPT>(p, grid, smem, s); break;
  }
}

}  // namespace bsa
#include "bitmap_sparse_attention_mma.cuh"
using namespace bsa;

// One translation unit per dtype so that ninja builds them in parallel.
template <typename T>
void dispatch(const Params& p, int nr, int cpt, dim3 grid, size_t smem, cudaStream_t s) {
  if (cpt == 1) dispatch_nr<T, 1>(p, nr, grid, smem, s);
  else dispatch_nr<T, 2>(p, nr, grid, smem, s);
}

#define BSA_INSTANTIATE(T) \
  template void dispatch<T>(const Params&, int, int, dim3, size_t, cudaStream_t); \
  template void bsa::launch_mma<T>(const Params&, dim3, size_t, cudaStream_t);

