// KIVI decode attention on the tensor cores with the codes dequantised in the MMA fragments: the
// CUDA backend of kvtool/kernels/kivi_attention.py (kivi_attention(..., backend="cuda")), reading
// the layout the format stores (no re-packed copy of the cache):
//   key codes   [BH, D, bytes along tokens]  (token t of channel d: bits (t % U') * BITS of byte t / U')
//   value codes [BH, tokens, bytes along channels]
//   key scales / zero points group-major [BH, groups, D] float16, value ones [BH, tokens, GV] float16.
//
// Why no Triton: a Triton tile of codes is dequantised in a blocked register layout and must go
// through shared memory again (2 bytes per element written and read) to reach the layout tl.dot
// wants; ncu put that kernel at 72% of the L1 / shared pipe with DRAM at 15% (docs/decode.md).
// Here the packed codes go global -> shared once (cp.async, 0.5 byte per 4-bit element) and
// `ldmatrix.trans` hands each lane a 32-bit word that holds, for two adjacent k of its MMA fragment,
// U = 16 / BITS codes each: in the KIVI layout the codes are packed along the axis the MMA does not
// reduce over (tokens for keys, channels for values), so a b16 unit of U codes read transposed is
// exactly "two k rows, one n column, U positions". Each position p is one n-tile: the n column c of
// n-tile p is token (or channel) U * c + p of the unit row. A code becomes float16 with a lop3
// (`0x6400 | code << k`: 1024 + code * 2^k) and two fma.rn.f16x2: the exact code, then
// code * scale + zero with one rounding (the format's float32 decode rounded to float16).
//
// Scores S = Q K^T: m16n8k16, A = the G * Tq query rows (padded to 16; the fragments stay in
// registers), B = dequantised keys (k = channels), n-tile p = tokens U * c + p of the sub-block.
// P V: the A fragment of k-step s is built from the S registers of n-tiles 2s and 2s + 1 (k = 2m + e
// <-> token U * 2m + 2s + e, k = 8 + 2m + e <-> token U * (2m + 1) + 2s + e), and the value
// matrices are loaded with those token rows (ldmatrix takes one row address per lane), so adjacent
// k are adjacent tokens and each value-scale pair is (token, token + 1).
//
// Work: one warp = one split of the blocks of BT tokens whose keys and values are all codes (below
// min(Tk, Tv), read from `lengths` on the device: no host sync, a captured launch stays valid while
// tokens join); its own cp.async ring of STAGES blocks in shared memory, no block-wide barrier. The
// online softmax is base 2; the partial (unnormalised accumulator, running max, running sum) goes
// to slot bh * (splits + 1) + split in the layout of kvtool/kernels/online_softmax.py, whose merge
// reads it; slot `splits` is the tail's (the blocks that mix codes and residual tokens).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace kivi {

struct Params {
  const half* q;            // [B, H, Tq, D], channel stride 1
  const uint8_t* kc;        // [BH, D, kc_c bytes]
  const half* ks;           // [BH, groups, D] (group stride ks_g halfs, channel stride 1)
  const half* kz;
  const uint8_t* vc;        // [BH, tokens, vc_t bytes]
  const half* vs;           // [BH, tokens, GV] (token stride vs_t halfs)
  const half* vz;
  const int* lengths;       // Tk, Tv, nk, nv
  float* acc;               // [BH * (splits + 1), 16, DP]
  float* m;                 // [BH * (splits + 1), 16]
  float* l;
  long long sq_b, sq_h, sq_t;
  long long kc_bh, kc_c;
  long long ks_bh, ks_g;
  long long vc_bh, vc_t;
  long long vs_bh, vs_t;
  int hkv, g, tq, rows, splits, dp, gv;  // gv: value groups per token
  int log2_group;           // key / value group (a power of two >= 16)
  int k16;                  // key rows (kc_c) and their base 16-byte aligned, else 4-byte copies
  int vs_align;             // 16, 4 or 2: the alignment of every head's value-scale rows (copies of that size)
  float scale_log2;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t h2u(half2 x) { return *reinterpret_cast<uint32_t*>(&x); }
__device__ __forceinline__ half2 u2h(uint32_t x) { return *reinterpret_cast<half2*>(&x); }
__device__ __forceinline__ uint32_t pack_f2(float lo, float hi) { return h2u(__floats2half2_rn(lo, hi)); }

// Code at position P of both b16 halves of `word` (r8 = word >> 8), dequantised: half2
// (code_lo * s.x + z.x, code_hi * s.y + z.y), each rounded once.
template <int BITS, int P>
__device__ __forceinline__ uint32_t dequant(uint32_t word, uint32_t r8, uint32_t s, uint32_t z) {
  constexpr int pb = P * BITS;
  constexpr int k = pb >= 8 ? pb - 8 : pb;
  constexpr uint32_t one = ((1u << BITS) - 1u) << k;
  constexpr uint32_t mask = one | (one << 16);
  constexpr uint32_t mul = (uint32_t)((15 - k) << 10) * 0x10001u;            // 2^-k
  constexpr uint32_t add = (uint32_t)(0x8000 | ((25 - k) << 10)) * 0x10001u;  // -1024 * 2^-k
  const uint32_t src = pb >= 8 ? r8 : word;
  uint32_t x, c, out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(x) : "r"(src), "n"(mask), "n"(0x64006400));  // 1024 + code * 2^k
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(c) : "r"(x), "r"(mul), "r"(add));           // the code, exactly
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(c), "r"(s), "r"(z));             // code * scale + zero
  return out;
}

// Value scales (or zero points) of block tokens t and t + 1, every group g < GV: out[g] = half2(x[t][g], x[t + 1][g]).
template <int GV>
__device__ __forceinline__ void load_pairs(const uint8_t* base, int t, uint32_t* out) {
  if constexpr (GV == 1) {
    out[0] = *reinterpret_cast<const uint32_t*>(base + t * 2);  // t even: one word
  } else if constexpr (GV == 2) {
    const uint32_t a = *reinterpret_cast<const uint32_t*>(base + t * 4), b = *reinterpret_cast<const uint32_t*>(base + t * 4 + 4);
    out[0] = __byte_perm(a, b, 0x5410);
    out[1] = __byte_perm(a, b, 0x7632);
  } else if constexpr (GV == 4) {
    const uint2 a = *reinterpret_cast<const uint2*>(base + t * 8), b = *reinterpret_cast<const uint2*>(base + t * 8 + 8);
    out[0] = __byte_perm(a.x, b.x, 0x5410); out[1] = __byte_perm(a.x, b.x, 0x7632);
    out[2] = __byte_perm(a.y, b.y, 0x5410); out[3] = __byte_perm(a.y, b.y, 0x7632);
  } else {
    const uint4 a = *reinterpret_cast<const uint4*>(base + t * 16), b = *reinterpret_cast<const uint4*>(base + t * 16 + 16);
    out[0] = __byte_perm(a.x, b.x, 0x5410); out[1] = __byte_perm(a.x, b.x, 0x7632);
    out[2] = __byte_perm(a.y, b.y, 0x5410); out[3] = __byte_perm(a.y, b.y, 0x7632);
    out[4] = __byte_perm(a.z, b.z, 0x5410); out[5] = __byte_perm(a.z, b.z, 0x7632);
    out[6] = __byte_perm(a.w, b.w, 0x5410); out[7] = __byte_perm(a.w, b.w, 0x7632);
  }
}

// out[i] for an i that is constant after unrolling, or one the lanes differ in (GV > matrices)
template <int N>
__device__ __forceinline__ uint32_t pick(const uint32_t (&x)[N], int i) {
  uint32_t r = x[0];
#pragma unroll
  for (int k = 1; k < N; ++k) r = i == k ? x[k] : r;
  return r;
}

template <int D, int BITS, int SUB>
struct Shape {
  static constexpr int U = 16 / BITS;                // codes per b16 unit
  static constexpr int BTS = 8 * U;                  // tokens per sub-block (16 bytes per key channel)
  static constexpr int BT = SUB * BTS;               // tokens per block
  static constexpr int NC = D * BITS / 128;          // 16-byte chunks per value token row
  static constexpr int NCM = D / (8 * U);            // value matrices across the channels (= NC)
  static constexpr int KBYTES = D * SUB * 16;        // key codes per block
  static constexpr int VBYTES = BT * D * BITS / 8;   // value codes per block
  static constexpr int LOG2U1 = BITS == 8 ? 2 : BITS == 4 ? 3 : 4;  // log2(2U)
};

// Bank-conflict-free placement of value chunk M of block token t: the 8 rows an ldmatrix reads are
// tokens {2U m + base + e} (m < 4, e < 2), so chunk M goes to M ^ (bits of m [and e]).
template <int NC, int LOG2U1>
__device__ __forceinline__ int vswz(int t, int chunk) {
  const int mbits = (t >> LOG2U1) & 3;
  if constexpr (NC >= 8) return chunk ^ ((t & 1) | (mbits << 1));
  else if constexpr (NC == 4) return chunk ^ mbits;
  else if constexpr (NC == 2) return chunk ^ (mbits & 1);
  else return chunk;
}

// The swapped kernel's value rows (kivi_decode_swapped.cuh): its ldmatrix reads the 8 tokens
// U r + p (r < 8) of a sub-block at once, so token t = U r + p of a sub-block goes to row slot 8 p + r
// and chunk M of slot s to M ^ (the bits of s the row's 16-byte units leave free): conflict-free.
template <int U, int BTS>
__device__ __forceinline__ int vslot(int t) {
  const int j = t / BTS, u = t % BTS;
  return j * BTS + (u % U) * 8 + u / U;
}
template <int NC>
__device__ __forceinline__ int vswz_t(int s, int chunk) {
  return chunk ^ (((s * NC) >> 3) & (NC - 1));
}

// The blocks of warp `warp` of CTA `cta` (WARPS warps, each one split of `splits`): the CTA takes
// WARPS * per consecutive blocks of the `full` all-code ones (per = ceil(full / splits)) and its warps
// interleave them, warp w taking blocks first + w, first + w + WARPS, ... So at any time the CTA's
// warps read adjacent 16-byte pieces of each key channel row (a 64-byte run at WARPS = 4). ncu on the
// H200 (kivi4, batch 8 x 32k): DRAM reads 1.09x the stored bytes with contiguous ranges per warp,
// 1.02x interleaved. Returns the warp's first block (the Ring's tb0 is first * BT) and sets its block count.
#ifndef KIVI_INTERLEAVE
#define KIVI_INTERLEAVE 1
#endif
constexpr bool INTERLEAVE = KIVI_INTERLEAVE;  // -DKIVI_INTERLEAVE=0: contiguous ranges per warp (comparisons)
template <int WARPS>
__device__ __forceinline__ int block_range(int cta, int warp, int full, int splits, int& nblk) {
  const int per = (full + splits - 1) / splits;
  if constexpr (!INTERLEAVE) {
    const int b0 = min((cta * WARPS + warp) * per, full);
    nblk = min(b0 + per, full) - b0;
    return b0;
  }
  const int start = min(cta * WARPS * per, full), end = min(start + WARPS * per, full);
  const int first = start + warp;
  nblk = first < end ? (end - first + WARPS - 1) / WARPS : 0;
  return min(first, full);
}

// One warp's cp.async ring of STAGES blocks of BT tokens in shared memory: the per-lane copies of
// a block (key codes, value codes, key scales / zero points transposed by quad, value scales / zero
// points in token order) and where each part of a stage lies. The warp's blocks are STRIDE blocks
// apart (the warps of a CTA interleave theirs: see block_range). TV: value rows placed by vslot /
// vswz_t (the swapped kernel), else in token order by vswz.
template <int D, int BITS, int SUB, int GV, int STAGES, bool TV, int STRIDE>
struct Ring {
  using SH = Shape<D, BITS, SUB>;
  static constexpr int U = SH::U, BTS = SH::BTS, BT = SH::BT, NC = SH::NC;
  static constexpr int VSBYTES = BT * GV * 2;       // value scales (or zero points) per block
  static constexpr int NK = D * SUB / 32;           // key chunks per lane: chunk lane + 32 r = [sub-block][channel]
  static constexpr int VCH = BT * NC;               // value chunks per block
  static constexpr int NV = (VCH + 31) / 32;        // value chunks per lane: token vt0 + r * 32 / NC, column vcol
  static constexpr int WPL = D / 64;                // key-scale words per lane and row (a row is D / 2 words)

  // the fields of Params issue() reads, by value (a reference would let its stores alias them)
  const long long ks_g, vc_t;
  const int k16, vs_align;
  const int lane, lg;
  const int nkg;          // key groups per block
  const int ksbytes;      // key scales (or zero points) per block
  const int stage_bytes;
  uint8_t* const ring;
  const uint32_t ring_s;
  const long long tb0;    // the warp's first token
  const uint8_t* kbase0;  // per-lane sources of the warp's first block (block blk adds blk * BT tokens)
  const uint8_t* vbase0;
  const half* kss;
  const half* kzs;
  const uint8_t* vsb0;
  const uint8_t* vzb0;
  int kofs[NK];           // per-lane offsets and destinations of a block's copies
  int vofs[NV];
  uint32_t vdsto[NV];
  uint32_t ksdo[WPL];

  __device__ __forceinline__ Ring(const Params& p, uint8_t* smem, int warp, int lane_, long long bh, long long tb0_)
      : ks_g(p.ks_g), vc_t(p.vc_t), k16(p.k16), vs_align(p.vs_align), lane(lane_), lg(p.log2_group), nkg(BT > (1 << p.log2_group) ? BT >> p.log2_group : 1),
        ksbytes(nkg * D * 2), stage_bytes(SH::KBYTES + SH::VBYTES + 2 * ksbytes + 2 * VSBYTES),
        ring(smem + (size_t)warp * STAGES * stage_bytes), ring_s(smem_u32(ring)), tb0(tb0_) {
    kbase0 = p.kc + bh * p.kc_bh + (long long)lane * p.kc_c + tb0 * BITS / 8;
#pragma unroll
    for (int r = 0; r < NK; ++r) kofs[r] = (int)(((32 * r) % D) * p.kc_c + ((32 * r) / D) * 16);
    const int vt0 = lane / NC, vcol = lane % NC;
    vbase0 = p.vc + bh * p.vc_bh + (tb0 + vt0) * p.vc_t + vcol * 16;
#pragma unroll
    for (int r = 0; r < NV; ++r) {
      const int t = vt0 + r * (32 / NC);
      vofs[r] = (int)(r * (32 / NC) * p.vc_t);
      if constexpr (TV) {
        const int sl = vslot<U, BTS>(t);
        vdsto[r] = (uint32_t)(sl * NC + vswz_t<NC>(sl, vcol)) * 16;
      } else {
        vdsto[r] = (uint32_t)(t * NC + vswz<NC, SH::LOG2U1>(t, vcol)) * 16;
      }
    }
    // key scales: 4-byte copies that put this lane's D / 8 pairs (channels 8 M' + 2 quad, + 1) side by
    // side: stage word quad * (D / 8) + M' of a row <- row word 4 M' + quad
#pragma unroll
    for (int k = 0; k < WPL; ++k) {
      const int w = lane + 32 * k;
      ksdo[k] = (uint32_t)((w & 3) * (D / 8) + (w >> 2)) * 4;
    }
    kss = p.ks + bh * p.ks_bh + 2 * lane;  // + 64 k: word lane + 32 k of a row
    kzs = p.kz + bh * p.ks_bh + 2 * lane;
    vsb0 = reinterpret_cast<const uint8_t*>(p.vs + bh * p.vs_bh + tb0 * GV);
    vzb0 = reinterpret_cast<const uint8_t*>(p.vz + bh * p.vs_bh + tb0 * GV);
  }

  // stage `slot`: shared addresses of the codes, generic pointers of the scales and zero points
  __device__ __forceinline__ uint32_t keys(int slot) const { return ring_s + slot * stage_bytes; }
  __device__ __forceinline__ uint32_t values(int slot) const { return keys(slot) + SH::KBYTES; }
  __device__ __forceinline__ const uint8_t* key_scales(int slot) const { return ring + slot * stage_bytes + SH::KBYTES + SH::VBYTES; }
  __device__ __forceinline__ const uint8_t* key_zeros(int slot) const { return key_scales(slot) + ksbytes; }
  __device__ __forceinline__ const uint8_t* value_scales(int slot) const { return key_scales(slot) + 2 * ksbytes; }
  __device__ __forceinline__ const uint8_t* value_zeros(int slot) const { return value_scales(slot) + VSBYTES; }

  // this lane's copies of the warp's block blk (tokens tb0 + blk * STRIDE * BT ..) into stage `slot` (not committed)
  __device__ __forceinline__ void issue(int blk, int slot) const {
    const uint32_t st = ring_s + slot * stage_bytes;
    const uint32_t vdst = st + SH::KBYTES, ksdst = vdst + SH::VBYTES, kzdst = ksdst + ksbytes, vsdst = kzdst + ksbytes,
                   vzdst = vsdst + VSBYTES;
    const long long toff = (long long)blk * STRIDE * BT;
    const uint8_t* kb = kbase0 + toff * BITS / 8;
    if (k16) {
#pragma unroll
      for (int r = 0; r < NK; ++r) cp16(st + (lane + 32 * r) * 16, kb + kofs[r]);
    } else {  // key rows of a length that is not a multiple of 16 bytes (a file's layer): 4-byte copies
#pragma unroll
      for (int r = 0; r < NK; ++r)
#pragma unroll
        for (int w = 0; w < 4; ++w) cp4(st + (lane + 32 * r) * 16 + 4 * w, kb + kofs[r] + 4 * w);
    }
    const uint8_t* vb = vbase0 + toff * vc_t;
#pragma unroll
    for (int r = 0; r < NV; ++r) {
      if (VCH % 32 == 0 || r < NV - 1 || lane < VCH % 32) cp16(vdst + vdsto[r], vb + vofs[r]);
    }
    const long long g0 = (tb0 + toff) >> lg;
    for (int row = 0; row < nkg; ++row) {  // the block's key-scale rows, transposed by quad
      const half* ksr = kss + (g0 + row) * ks_g;
      const half* kzr = kzs + (g0 + row) * ks_g;
      const uint32_t rd = row * (D * 2);
#pragma unroll
      for (int k = 0; k < WPL; ++k) {
        cp4(ksdst + rd + ksdo[k], ksr + 64 * k);
        cp4(kzdst + rd + ksdo[k], kzr + 64 * k);
      }
    }
    const uint8_t* vsb = vsb0 + toff * GV * 2;
    const uint8_t* vzb = vzb0 + toff * GV * 2;
    if (vs_align == 16) {
#pragma unroll
      for (int i = lane; i < 2 * (VSBYTES / 16); i += 32) {
        if (i < VSBYTES / 16) cp16(vsdst + i * 16, vsb + i * 16);
        else cp16(vzdst + (i - VSBYTES / 16) * 16, vzb + (i - VSBYTES / 16) * 16);
      }
    } else if (vs_align == 4) {  // a file's layer whose token count leaves the heads' rows 4-byte aligned
      for (int i = lane; i < 2 * (VSBYTES / 4); i += 32) {
        if (i < VSBYTES / 4) cp4(vsdst + i * 4, vsb + i * 4);
        else cp4(vzdst + (i - VSBYTES / 4) * 4, vzb + (i - VSBYTES / 4) * 4);
      }
    } else {  // 2-byte aligned: plain loads and stores (this warp reads them after its __syncwarp)
      half* vsd = reinterpret_cast<half*>(ring + (vsdst - ring_s));
      half* vzd = reinterpret_cast<half*>(ring + (vzdst - ring_s));
      const half* vsh = reinterpret_cast<const half*>(vsb);
      const half* vzh = reinterpret_cast<const half*>(vzb);
      for (int i = lane; i < VSBYTES / 2; i += 32) { vsd[i] = vsh[i]; vzd[i] = vzh[i]; }
    }
  }
};

template <int D, int BITS, int SUB, int GV, int STAGES, int WARPS, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB) kivi_decode_kernel(Params p) {
  using SH = Shape<D, BITS, SUB>;
  constexpr int U = SH::U, BTS = SH::BTS, BT = SH::BT, NC = SH::NC, NCM = SH::NCM;
  constexpr int KSTEPS = D / 16;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad = lane & 3, col = lane >> 2;
  const long long bh = blockIdx.y;
  const int split = blockIdx.x * WARPS + warp;
  const int lg = p.log2_group;
  const int full = min(__ldg(p.lengths), __ldg(p.lengths + 1)) / BT;
  int nblk;
  const int b0 = block_range<WARPS>(blockIdx.x, warp, full, p.splits, nblk);
  const Ring<D, BITS, SUB, GV, STAGES, false, INTERLEAVE ? WARPS : 1> ring(p, smem, warp, lane, bh, (long long)b0 * BT);
  const int nkg = ring.nkg, stage_bytes = ring.stage_bytes;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nblk) ring.issue(s, s);
    cp_commit();
  }

  // the query rows (G * Tq, padded to 16 with zeros; row -> query head kh * G + r / Tq, token
  // r % Tq) in shared memory once per block of warps (they share the KV head), rows of D + 8 halves
  // so that ldmatrix's 8 row reads fall in distinct banks; each k-step's A fragment is one ldmatrix
  constexpr int QROW = D + 8;
  half* qs = reinterpret_cast<half*>(smem + (size_t)WARPS * STAGES * stage_bytes);
  {
    const int kh = (int)(bh % p.hkv);
    const long long bb = bh / p.hkv;
    for (int i = threadIdx.x; i < 16 * (D / 8); i += WARPS * 32) {
      const int r = i / (D / 8), c8 = i % (D / 8);
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < p.rows) {
        const half* src = p.q + bb * p.sq_b + (long long)(kh * p.g + r / p.tq) * p.sq_h + (r % p.tq) * p.sq_t + c8 * 8;
        const uint32_t* s32 = reinterpret_cast<const uint32_t*>(src);
        v = make_uint4(s32[0], s32[1], s32[2], s32[3]);
      }
      *reinterpret_cast<uint4*>(qs + r * QROW + c8 * 8) = v;
    }
    __syncthreads();
  }
  // lane -> matrix lane / 8 (rows 0-7 / 8-15, k 0-7 / 8-15 of a k-step): a0, a1, a2, a3 of mma.m16n8k16
  const uint32_t qaddr = smem_u32(qs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * QROW + 8 * (lane >> 4));

  // ldmatrix row addresses of the value matrices (relative to a stage's values), per k-step and
  // chunk pair: lane -> matrix lane / 8 (0: b0 of chunk M, 1: b1 of M, 2: b0 of M + 1, 3: b1 of M + 1)
  constexpr int MP = (NCM + 1) / 2;
  uint32_t vaddr[SUB][U / 2][MP];
  {
    const int r = lane & 7, mat = lane >> 3;
#pragma unroll
    for (int j = 0; j < SUB; ++j)
#pragma unroll
      for (int ss = 0; ss < U / 2; ++ss)
#pragma unroll
        for (int mp = 0; mp < MP; ++mp) {
          const int tr = j * BTS + 2 * U * (r >> 1) + 2 * ss + (r & 1) + ((mat & 1) ? U : 0);
          const int chunk = NCM >= 2 ? 2 * mp + (mat >> 1) : 0;
          vaddr[j][ss][mp] = (tr * NC + vswz<NC, SH::LOG2U1>(tr, chunk)) * 16;
        }
  }

  float o[NCM][U][4];
#pragma unroll
  for (int a = 0; a < NCM; ++a)
#pragma unroll
    for (int b = 0; b < U; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[a][b][c] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // running max of the base-2 scores, lane-partial sums
  const float sl2 = p.scale_log2;

  for (int blk = 0; blk < nblk; ++blk) {
    if (blk + STAGES - 1 < nblk) ring.issue(blk + STAGES - 1, (blk + STAGES - 1) % STAGES);
    cp_commit();
    cp_wait<STAGES - 1>();
    __syncwarp();
    const int slot = blk % STAGES;
    const uint32_t kbase = ring.keys(slot), vbase = ring.values(slot);
    const uint4* ksm = reinterpret_cast<const uint4*>(ring.key_scales(slot));
    const uint4* kzm = reinterpret_cast<const uint4*>(ring.key_zeros(slot));
    const uint8_t* vsm = ring.value_scales(slot);
    const uint8_t* vzm = ring.value_zeros(slot);

#pragma unroll
    for (int j = 0; j < SUB; ++j) {
      // ---- scores of sub-block j: n-tile pos <-> tokens U * c + pos
      float s[U][4];
#pragma unroll
      for (int a = 0; a < U; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[a][c] = 0.f;
      const int krow = nkg > 1 ? (j * BTS + U * col) >> lg : 0;  // this lane's key group in the block
      const uint4* ksr = ksm + krow * (D / 8) + quad * (D / 32);  // this lane's D / 8 scale pairs, 4 per uint4
      const uint4* kzr = kzm + krow * (D / 8) + quad * (D / 32);
#pragma unroll
      for (int h = 0; h < KSTEPS / 2; ++h) {
        uint32_t w[4];
        ldsm_x4_t(kbase + (j * D + 32 * h + lane) * 16, w[0], w[1], w[2], w[3]);
        uint32_t qa[2][4];
        ldsm_x4(qaddr + 2 * h * 32, qa[0][0], qa[0][1], qa[0][2], qa[0][3]);        // k-step 2h: channels 32h ..
        ldsm_x4(qaddr + (2 * h + 1) * 32, qa[1][0], qa[1][1], qa[1][2], qa[1][3]);  // k-step 2h + 1
        const uint4 sv = ksr[h], zv = kzr[h];  // pairs of matrices 4h .. 4h + 3
        const uint32_t sc[4] = {sv.x, sv.y, sv.z, sv.w}, zc[4] = {zv.x, zv.y, zv.z, zv.w};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t wa = w[2 * e], wb = w[2 * e + 1];
          const uint32_t sa = sc[2 * e], za = zc[2 * e], sb = sc[2 * e + 1], zb = zc[2 * e + 1];
          const uint32_t wa8 = wa >> 8, wb8 = wb >> 8;
#pragma unroll
          for (int pos = 0; pos < U; ++pos) {
            uint32_t b0, b1;
            switch (pos) {  // a template position (constant after unrolling)
#define KIVI_POS(P) case P: b0 = dequant<BITS, (P < U ? P : 0)>(wa, wa8, sa, za); b1 = dequant<BITS, (P < U ? P : 0)>(wb, wb8, sb, zb); break;
              KIVI_POS(0) KIVI_POS(1) KIVI_POS(2) KIVI_POS(3) KIVI_POS(4) KIVI_POS(5) KIVI_POS(6) KIVI_POS(7)
#undef KIVI_POS
              default: b0 = b1 = 0u;
            }
            mma16816(s[pos], qa[e], b0, b1);
          }
        }
      }
      // ---- online softmax in base 2 (rows col and col + 8; a quad shares a row)
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int a = 0; a < U; ++a) {
        mx0 = fmaxf(mx0, fmaxf(s[a][0], s[a][1]));
        mx1 = fmaxf(mx1, fmaxf(s[a][2], s[a][3]));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      mx0 = fmaxf(m0, mx0 * sl2);
      mx1 = fmaxf(m1, mx1 * sl2);
      const float al0 = ex2(m0 - mx0), al1 = ex2(m1 - mx1);  // m = -inf at first: exp2(-inf) = 0
      m0 = mx0; m1 = mx1;
      float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
      for (int a = 0; a < U; ++a) {
        s[a][0] = ex2(fmaf(s[a][0], sl2, -mx0)); s[a][1] = ex2(fmaf(s[a][1], sl2, -mx0));
        s[a][2] = ex2(fmaf(s[a][2], sl2, -mx1)); s[a][3] = ex2(fmaf(s[a][3], sl2, -mx1));
        ps0 += s[a][0] + s[a][1];
        ps1 += s[a][2] + s[a][3];
      }
      l0 = l0 * al0 + ps0;
      l1 = l1 * al1 + ps1;
      if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {  // the running max moved: rescale
#pragma unroll
        for (int a = 0; a < NCM; ++a)
#pragma unroll
          for (int b = 0; b < U; ++b) {
            o[a][b][0] *= al0; o[a][b][1] *= al0; o[a][b][2] *= al1; o[a][b][3] *= al1;
          }
      }
      // ---- P V, k-step ss over the S n-tiles 2ss, 2ss + 1
#pragma unroll
      for (int ss = 0; ss < U / 2; ++ss) {
        uint32_t pa[4];
        pa[0] = pack_f2(s[2 * ss][0], s[2 * ss + 1][0]);
        pa[1] = pack_f2(s[2 * ss][2], s[2 * ss + 1][2]);
        pa[2] = pack_f2(s[2 * ss][1], s[2 * ss + 1][1]);
        pa[3] = pack_f2(s[2 * ss][3], s[2 * ss + 1][3]);
        // this lane's B rows are tokens ta, ta + 1 (b0) and ta + U, ta + U + 1 (b1): their scales, every group
        const int ta = j * BTS + 2 * U * quad + 2 * ss;
        uint32_t vsa[GV], vza[GV], vsb[GV], vzb[GV];
        load_pairs<GV>(vsm, ta, vsa);
        load_pairs<GV>(vzm, ta, vza);
        load_pairs<GV>(vsm, ta + U, vsb);
        load_pairs<GV>(vzm, ta + U, vzb);
#pragma unroll
        for (int mp = 0; mp < MP; ++mp) {
          uint32_t w[4];
          if constexpr (NCM >= 2) {
            ldsm_x4_t(vbase + vaddr[j][ss][mp], w[0], w[1], w[2], w[3]);
          } else {
            ldsm_x2_t(vbase + vaddr[j][ss][mp], w[0], w[1]);
            w[2] = w[3] = 0u;
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int M = 2 * mp + e;
            if (M >= NCM) break;
            // value group of channels 8U M + U col .. + U - 1 (this lane's n column)
            const int vg = GV <= NCM ? (M * GV) / NCM : ((8 * U * M + U * col) * GV) / D;
            const uint32_t sa = pick(vsa, vg), za = pick(vza, vg), sb = pick(vsb, vg), zb = pick(vzb, vg);
            const uint32_t wa = w[2 * e], wb = w[2 * e + 1];
            const uint32_t wa8 = wa >> 8, wb8 = wb >> 8;
#pragma unroll
            for (int pos = 0; pos < U; ++pos) {
              uint32_t b0, b1;
              switch (pos) {
#define KIVI_POS(P) case P: b0 = dequant<BITS, (P < U ? P : 0)>(wa, wa8, sa, za); b1 = dequant<BITS, (P < U ? P : 0)>(wb, wb8, sb, zb); break;
                KIVI_POS(0) KIVI_POS(1) KIVI_POS(2) KIVI_POS(3) KIVI_POS(4) KIVI_POS(5) KIVI_POS(6) KIVI_POS(7)
#undef KIVI_POS
                default: b0 = b1 = 0u;
              }
              mma16816(o[M][pos], pa, b0, b1);
            }
          }
        }
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_wait<0>();

  // ---- the partial: rows col, col + 8 (if real); o[M][pos] c0 / c1 = channels 8U M + U (2q) + pos, 8U M + U (2q + 1) + pos
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const long long slot = bh * (p.splits + 1) + split;
  float* acc = p.acc + slot * 16 * p.dp;
  const int r0 = col, r1 = col + 8;
#pragma unroll
  for (int M = 0; M < NCM; ++M)
#pragma unroll
    for (int pos = 0; pos < U; ++pos) {
      const int c0 = 8 * U * M + U * (2 * quad) + pos, c1 = c0 + U;
      if (r0 < p.rows) { acc[r0 * p.dp + c0] = o[M][pos][0]; acc[r0 * p.dp + c1] = o[M][pos][1]; }
      if (r1 < p.rows) { acc[r1 * p.dp + c0] = o[M][pos][2]; acc[r1 * p.dp + c1] = o[M][pos][3]; }
    }
  if (quad == 0) {
    if (r0 < p.rows) { p.m[slot * 16 + r0] = m0; p.l[slot * 16 + r0] = l0; }
    if (r1 < p.rows) { p.m[slot * 16 + r1] = m1; p.l[slot * 16 + r1] = l1; }
  }
}

template <int D, int BITS, int SUB, int GV>
int stage_bytes(int nkg) {
  using SH = Shape<D, BITS, SUB>;
  return SH::KBYTES + SH::VBYTES + 2 * nkg * D * 2 + 2 * SH::BT * GV * 2;
}

// dynamic shared memory of one block: WARPS rings of STAGES blocks, then the query rows
template <int D, int BITS, int SUB, int GV>
int block_smem(int nkg, int stages, int warps) {
  return warps * stages * stage_bytes<D, BITS, SUB, GV>(nkg) + 16 * (D + 8) * 2;
}

}  // namespace kivi
