// Per-token magnitude pruning and bitmap encoding in one launch: the CUDA backend of
// kvtool/kernels/bitmap_prune_encode.py (layout: kvtool/kernels/bitmap_layout.py).
//
// One program = one 64-token layout block of one KV head: one thread per token (two for
// head_dim 256). cp.async stages the block's rows in shared memory; a thread holds its token's
// (half) row as fp16 pairs in registers and finds the row's keep-th largest magnitude T by
// bisection over the 15-bit magnitude patterns (compared as fp16 with HSET2's |x| modifier, two
// elements per instruction; the 0xFFFF masks are summed with IADD3 and the two halves' counts
// recovered from the sum). Bound: instruction issue, two thirds of it the bisection. The keep mask is |x| >= T with ties at T going to the lowest
// channels (a stable descending sort's choice) and +0.0 never stored, exactly what pruning with
// kvtool.methods.prune and then encoding gives. Token tiles use each thread's 64-bit mask as is;
// channel tiles transpose a warp's masks with shuffles. Every thread (token tiles) or channel
// (channel tiles) then walks its word's set bits into the block's packed run in shared memory,
// which leaves as 16-byte stores.
//
// No host sync between passes: per-token pruning stores exactly keep elements per row, so every
// block's place in nz follows from the shapes. A block that stores fewer (a row with fewer than
// keep non-zero patterns) still lands at that place; it raises flag bit 0 and the host compacts.
// A magnitude pattern above +inf (a NaN, or a bfloat16 above 2^121 read as fp16) raises bit 1 and
// the host falls back to the torch path.
#include <torch/extension.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace bpe {

struct Params {
  const uint16_t* x;             // [BH, Tc, D] 16-bit patterns (float16 or bfloat16)
  unsigned long long* bitmaps;   // token tiles [BH, Tc, P]; channel tiles [BH, NB, D]
  uint16_t* nz;                  // block g's run from bh * head_elems + blk * 64 * keep
  long long* offsets;            // [BH * NB + 1] block g's run start (if all blocks are full)
  int* counts;                   // [BH * NB] elements stored per block
  int* flag;                     // bit 0: a block stored fewer than rows * keep; bit 1: a NaN
  int Tc, NB, keep;
  long long head_elems;
};

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}

__device__ __forceinline__ __half2 as_half2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Interleave bits 0..15 (even elements) with bits 16..31 (odd elements): bit e = element e.
__device__ __forceinline__ uint32_t interleave(uint32_t x) {
  uint32_t t;
  t = (x ^ (x >> 8)) & 0x0000FF00u; x ^= t ^ (t << 8);
  t = (x ^ (x >> 4)) & 0x00F000F0u; x ^= t ^ (t << 4);
  t = (x ^ (x >> 2)) & 0x0C0C0C0Cu; x ^= t ^ (t << 2);
  t = (x ^ (x >> 1)) & 0x22222222u; x ^= t ^ (t << 1);
  return x;
}

// Masks of the thread's elements with |x| >= t (t a magnitude pattern <= 0x7c01), natural order:
// m[i] bit e = element 32 i + e. HSET2 reads |x| through its operand modifier.
template <int W>
__device__ __forceinline__ void mask_ge(const uint32_t (&a)[W], int t, uint32_t (&m)[W / 16]) {
  const __half2 t2 = as_half2((uint32_t)t * 0x10001u);
#pragma unroll
  for (int w = 0; w < W / 16; ++w) {
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i)  // a half of an HSET2 mask is all ones or all zeros: keep bit i of each
      packed |= __hge2_mask(__habs2(as_half2(a[16 * w + i])), t2) & (0x00010001u << i);
    m[w] = interleave(packed);
  }
}

// Elements of the thread with |x| >= t, as the sum s of the HSET2 masks (lo, hi: the counts of
// the low and high halves): s = lo * 0xFFFF + hi * 0xFFFF0000 (mod 2^32) = 2^16 (lo - hi) - lo.
template <int W>
__device__ __forceinline__ uint32_t mask_sum_ge(const uint32_t (&a)[W], int t) {
  const __half2 t2 = as_half2((uint32_t)t * 0x10001u);
  uint32_t s0 = 0, s1 = 0;
#pragma unroll
  for (int i = 0; i < W; i += 4) {
    s0 += __hge2_mask(__habs2(as_half2(a[i])), t2) + __hge2_mask(__habs2(as_half2(a[i + 1])), t2);
    s1 += __hge2_mask(__habs2(as_half2(a[i + 2])), t2) + __hge2_mask(__habs2(as_half2(a[i + 3])), t2);
  }
  return s0 + s1;
}

// The count in a mask sum (lo, hi < 2^15; sums of several threads' mask sums decode alike):
// -s = lo + 2^16 (hi - lo), so lo is its low half and hi - lo its arithmetic high half.
__device__ __forceinline__ int decode_count(uint32_t s) {
  const int u = (int)(0u - s);
  return 2 * (u & 0xFFFF) + (u >> 16);
}

// Sum over the TPR threads of a row (lanes part * RW + r).
template <int RW, typename T>
__device__ __forceinline__ T row_sum(T n) {
#pragma unroll
  for (int o = RW; o < 32; o <<= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
  return n;
}

template <int N>
__device__ __forceinline__ int popc_all(const uint32_t (&m)[N]) {
  int c = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) c += __popc(m[i]);
  return c;
}

// 32x32 bit transpose across the warp: bit i of lane L becomes bit L of lane i.
__device__ __forceinline__ uint32_t transpose32(uint32_t x, int lane) {
  uint32_t m = 0x0000FFFFu;
#pragma unroll
  for (int s = 16; s > 0; s >>= 1, m ^= m << s) {
    const uint32_t y = __shfl_xor_sync(0xffffffffu, x, s);
    x = (lane & s) ? ((x & ~m) | ((y >> s) & m)) : ((x & m) | ((y << s) & ~m));
  }
  return x;
}

// In place: s[0..N) -> exclusive prefix sums, s[N] = total. Called by warp 0 between barriers.
template <int N>
__device__ __forceinline__ void warp_exclusive_scan(int* s, int lane) {
  constexpr int PER = (N + 31) / 32;
  int v[PER], sum = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) { v[i] = lane * PER + i < N ? s[lane * PER + i] : 0; sum += v[i]; }
  int inc = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  int run = inc - sum;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    if (lane * PER + i < N) s[lane * PER + i] = run;
    run += v[i];
  }
  if (lane == 31) s[N] = inc;
}

// Threads per token: one up to 128 channels (128 elements in 64 registers), two for 256.
template <int D> struct Shape {
  static constexpr int TPR = D > 128 ? 2 : 1;  // threads per row
  static constexpr int E = D / TPR;            // elements per thread
  static constexpr int W = E / 2;              // 32-bit words per thread
  static constexpr int NT = 64 * TPR;          // threads per program
  static constexpr int RW = 32 / TPR;          // rows per warp
  static constexpr int RS = 2 * D + 16;        // row stride in shared memory (bytes): a quarter
                                               // warp's 16-byte reads of 8 rows hit 8 bank groups
};

template <int D, bool CHANNEL_TILES>
__global__ void __launch_bounds__(Shape<D>::NT) prune_encode_kernel(Params p) {
  using S = Shape<D>;
  constexpr int TPR = S::TPR, E = S::E, W = S::W, NT = S::NT, RW = S::RW, RS = S::RS;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* tile = smem;                                                        // 64 rows * RS
  unsigned long long* cw = reinterpret_cast<unsigned long long*>(smem + 64 * RS);   // channel words [D]
  int* scan = reinterpret_cast<int*>(cw + D);                                        // D + 32
  uint16_t* out = reinterpret_cast<uint16_t*>(scan + D + 32);                        // the block's run
  const uint16_t* tile16 = reinterpret_cast<const uint16_t*>(tile);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long g = blockIdx.x;
  const int bh = (int)(g / p.NB), blk = (int)(g % p.NB);
  const int rows = min(64, p.Tc - blk * 64);
  const unsigned char* src = reinterpret_cast<const unsigned char*>(p.x + ((long long)bh * p.Tc + (long long)blk * 64) * D);

  constexpr int CPR = D / 8;  // 16-byte chunks per row
  if (rows == 64) {  // the block is contiguous: chunk i = tid + k * NT, at a fixed offset per k
    const int r0 = tid / CPR, c0 = tid % CPR;
#pragma unroll
    for (int k = 0; k < 64 * CPR / NT; ++k)
      cp16(tile + (r0 + k * (NT / CPR)) * RS + c0 * 16, src + (tid + k * NT) * 16);
  } else {
    for (int i = tid; i < 64 * CPR; i += NT) {
      const int r = i / CPR, c = i % CPR;
      unsigned char* dst = tile + r * RS + c * 16;
      if (r < rows) cp16(dst, src + (long long)i * 16);
      else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::);
  __syncthreads();

  const int r = warp * RW + lane % RW, part = lane / RW;
  uint32_t a[W];
  __half2 top = __float2half2_rn(0.f);
  const uint4* mine = reinterpret_cast<const uint4*>(tile + r * RS + part * E * 2);
#pragma unroll
  for (int j = 0; j < W / 4; ++j) {
    const uint4 v = mine[j];
    a[4 * j] = v.x; a[4 * j + 1] = v.y; a[4 * j + 2] = v.z; a[4 * j + 3] = v.w;
    top = __hmax2_nan(top, __hmax2_nan(__habs2(as_half2(v.x)), __habs2(as_half2(v.y))));
    top = __hmax2_nan(top, __hmax2_nan(__habs2(as_half2(v.z)), __habs2(as_half2(v.w))));
  }
  const uint32_t topu = *reinterpret_cast<uint32_t*>(&top);
  const bool nan = (topu & 0xFFFFu) > 0x7c00u || (topu >> 16) > 0x7c00u;

  const int keep = p.keep;
  uint32_t mask[W / 16] = {};
  if (keep > 0) {
    // largest T with count(|x| >= T) >= keep: halvings of [0, 0x7c01) (15 at most); a row whose
    // count is keep exactly is done early, and the warp stops once all of its rows are
    int lo = 0, hi = 0x7c01;
    do {
      const int mid = (lo + hi) >> 1;
      const int n = decode_count(row_sum<RW>(mask_sum_ge(a, mid)));
      if (n == keep) { lo = mid; hi = mid + 1; }
      else if (n > keep) lo = mid;
      else hi = mid;
    } while (!__all_sync(0xffffffffu, hi - lo <= 1));  // 0 only in a row with a NaN (flagged below)
    const int T = lo;
    mask_ge(a, T, mask);
    const bool tie = row_sum<RW>(popc_all(mask)) != keep;
    if (__any_sync(0xffffffffu, tie)) {  // more than keep at T: the lowest channels among the ties
      uint32_t gt[W / 16];
      mask_ge(a, T + 1, gt);
      const int need = keep - row_sum<RW>(popc_all(gt));
      int n_eq = 0;
#pragma unroll
      for (int w = 0; w < W / 16; ++w) n_eq += __popc(mask[w] & ~gt[w]);
      int before = n_eq;  // inclusive scan over the parts of the row, then exclusive
#pragma unroll
      for (int o = RW; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, before, o);
        if (lane >= o) before += y;
      }
      before -= n_eq;
      if (tie) {
        int take = max(0, min(n_eq, need - before));  // ties kept, lowest element first
#pragma unroll
        for (int w = 0; w < W / 16; ++w) {
          uint32_t eq = mask[w] & ~gt[w];
          const int here = min(take, __popc(eq));
          for (int d = __popc(eq) - here; d > 0; --d) eq &= ~(1u << (31 - __clz(eq)));
          take -= here;
          mask[w] = gt[w] | eq;
        }
      }
    }
    if (T == 0) {  // a +0.0 among the kept elements is pruned output, not a stored element
      const uint16_t* row = tile16 + r * (RS / 2) + part * E;
#pragma unroll
      for (int w = 0; w < W / 16; ++w) {
        uint32_t stored = 0;
        for (int e = 0; e < 32; ++e) stored |= (uint32_t)(row[32 * w + e] != 0) << e;
        mask[w] &= stored;
      }
    }
  }
  if (r >= rows) {
#pragma unroll
    for (int w = 0; w < W / 16; ++w) mask[w] = 0;
  }
  if (nan && r < rows) atomicOr(p.flag, 2);

  int total;
  if (!CHANNEL_TILES) {  // token tiles: each 64 bits of the thread's mask is a tile's bitmap
    const int c = popc_all(mask);
    scan[r * TPR + part] = c;
    __syncthreads();
    if (warp == 0) warp_exclusive_scan<NT>(scan, lane);
    __syncthreads();
    int end = scan[r * TPR + part] + c;  // runs in (row, channel) order: walk the last tile first
    total = scan[NT];
    const uint16_t* row = tile16 + r * (RS / 2) + part * E;
#pragma unroll
    for (int w = W / 16 - 1; w >= 0; --w) {
      uint32_t m = mask[w];
      while (m) {  // highest bit first: its place is the run's end minus the bits after it
        const int e = 31 - __clz(m);
        m ^= 1u << e;
        out[--end] = row[32 * w + e];
      }
    }
    if (r < rows) {
      unsigned long long* bm = p.bitmaps + ((long long)bh * p.Tc + blk * 64 + r) * (D / 64) + part * (E / 64);
#pragma unroll
      for (int t = 0; t < E / 64; ++t) bm[t] = (unsigned long long)mask[2 * t] | ((unsigned long long)mask[2 * t + 1] << 32);
    }
  } else {  // channel tiles: transpose the warp's masks into channel words over its RW rows
    using Piece = typename std::conditional<RW == 32, uint32_t, uint16_t>::type;
    Piece* pieces = reinterpret_cast<Piece*>(cw);  // channel c's word = pieces [c * 64 / RW, ...)
#pragma unroll
    for (int w = 0; w < W / 16; ++w) {
      const uint32_t x = transpose32(mask[w], lane);  // bits q*RW..: part q's rows, channel q*E + 32w + lane
#pragma unroll
      for (int q = 0; q < TPR; ++q) pieces[(q * E + 32 * w + lane) * (64 / RW) + warp] = (Piece)(x >> (q * RW));
    }
    __syncthreads();
    constexpr int CPT = D / NT;  // channels per thread, consecutive
    unsigned long long words[CPT];
    int c = 0;
#pragma unroll
    for (int i = 0; i < CPT; ++i) { words[i] = cw[tid * CPT + i]; c += __popcll(words[i]); }
    scan[tid] = c;
    __syncthreads();
    if (warp == 0) warp_exclusive_scan<NT>(scan, lane);
    __syncthreads();
    int end = scan[tid] + c;
    total = scan[NT];
#pragma unroll
    for (int i = 2 * CPT - 1; i >= 0; --i) {  // 32 tokens at a time: 32-bit bit operations
      uint32_t m = (uint32_t)(words[i / 2] >> (32 * (i % 2)));
      const uint16_t* col = tile16 + 32 * (i % 2) * (RS / 2) + tid * CPT + i / 2;
      while (m) {
        const int t = 31 - __clz(m);
        m ^= 1u << t;
        out[--end] = col[t * (RS / 2)];
      }
    }
#pragma unroll
    for (int i = 0; i < CPT; ++i) p.bitmaps[g * D + tid * CPT + i] = words[i];
  }
  const int padded = (total + 7) & ~7;
  if (tid < padded - total) out[total + tid] = 0;
  __syncthreads();
  const long long start = (long long)bh * p.head_elems + (long long)blk * 64 * keep;
  uint4* dst = reinterpret_cast<uint4*>(p.nz + start);
  const uint4* run = reinterpret_cast<const uint4*>(out);
  for (int i = tid; i < padded / 8; i += NT) dst[i] = run[i];
  if (tid == 0) {
    p.offsets[g] = start;
    if (g == gridDim.x - 1) p.offsets[g + 1] = (long long)(bh + 1) * p.head_elems;
    p.counts[g] = total;
    if (total != rows * keep) atomicOr(p.flag, 1);
  }
}

template <int D, bool CT>
void launch(const Params& p, int blocks, size_t smem, cudaStream_t s) {
  auto k = prune_encode_kernel<D, CT>;
  if (smem > 48 * 1024) cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  k<<<blocks, Shape<D>::NT, smem, s>>>(p);
}

}  // namespace bpe

// x int16 [BH, Tc, D] (D in 64, 128, 256); bitmaps int64; nz int16 (bh * head_elems); offsets int64
// [BH * NB + 1]; counts int32 [BH * NB]; flag int32 [1] (zeroed by the caller).
void prune_encode(torch::Tensor x, torch::Tensor bitmaps, torch::Tensor nz, torch::Tensor offsets, torch::Tensor counts, torch::Tensor flag,
                  int64_t keep, int64_t head_elems, bool channel_tiles, int64_t stream) {
  const int bh = (int)x.size(0), tc = (int)x.size(1), d = (int)x.size(2);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "head_dim must be 64, 128 or 256");
  TORCH_CHECK(keep >= 0 && keep <= d, "keep must be in [0, head_dim]");
  bpe::Params p;
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  p.bitmaps = reinterpret_cast<unsigned long long*>(bitmaps.data_ptr());
  p.nz = reinterpret_cast<uint16_t*>(nz.data_ptr());
  p.offsets = reinterpret_cast<long long*>(offsets.data_ptr<int64_t>());
  p.counts = counts.data_ptr<int>();
  p.flag = flag.data_ptr<int>();
  p.Tc = tc; p.NB = (tc + 63) / 64; p.keep = (int)keep; p.head_elems = head_elems;
  const int blocks = bh * p.NB;
  if (blocks == 0) return;
  const size_t smem = 64 * (2 * d + 16) + d * 8 + (d + 32) * 4 + ((64 * keep + 8) * 2 + 15) / 16 * 16;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (d == 64) channel_tiles ? bpe::launch<64, true>(p, blocks, smem, s) : bpe::launch<64, false>(p, blocks, smem, s);
  else if (d == 128) channel_tiles ? bpe::launch<128, true>(p, blocks, smem, s) : bpe::launch<128, false>(p, blocks, smem, s);
  else channel_tiles ? bpe::launch<256, true>(p, blocks, smem, s) : bpe::launch<256, false>(p, blocks, smem, s);
  const cudaError_t e = cudaGetLastError();
  TORCH_CHECK(e == cudaSuccess, "bitmap_prune_encode: ", cudaGetErrorString(e));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prune_encode", &prune_encode, "per-token magnitude pruning + bitmap encoding, one launch");
}
