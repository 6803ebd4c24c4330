// KIVI decode attention with the MMA operands swapped, for at most 8 query rows per KV head (G * Tq
// <= 8: Llama-3-8B's 4, SmolLM2's 3): the codes are the A operand and the queries the B operand, so an
// m16n8k16 covers 16 tokens (or channels) x 8 query rows instead of 16 query rows (12 of them zero
// padding at G = 4) x 8 tokens. Half the MMAs of kivi_decode.cuh and half its output accumulators
// (32 registers at head_dim 128 instead of 64), the same copies (kivi::Ring), the query fragments
// held in registers. Values dequantise as there (three instructions per two codes); keys too, unless
// a key group holds a whole sub-block, where their scales fold into the queries (FOLD, below: one
// lop3 per two codes).
//
// Scores S^T = K Q^T per sub-block of BTS = 8U tokens: m-tile mt holds tokens U g + 2mt (rows g < 8)
// and U g + 2mt + 1 (rows 8 + g) of the sub-block, where g = lane / 4 is the unit column ldmatrix.trans
// hands the lane (kivi_decode.cuh's header). Its A fragment is the two positions 2mt, 2mt + 1 of the
// key words of kivi_decode.cuh's B fragments, so the dequantisation is the same per lane and word. The
// accumulator holds for the lane token rows g, g + 8 and query columns 2 quad, 2 quad + 1.
//
// P V as O^T = V^T P^T, k-step mt over the tokens of score m-tile mt: B = P^T, whose fragment is the
// score accumulator transposed 8 x 8 by movmatrix (k = i < 8 <-> token U i + 2mt, k = 8 + i <-> U i +
// 2mt + 1); A = V^T, m-tile (chunk M, position pair pp): channels 8U M + U g + 2pp (rows g) and + 1
// (rows 8 + g), from ldmatrix.trans of the value rows of tokens U r + 2mt (+ 1), which the copies put
// on consecutive rows (kivi::vslot) in chunks swizzled for it (kivi::vswz_t). Each 32-bit word so holds
// one channel unit of tokens U 2q + p and U (2q + 1) + p: their value-scale pair is read from the two
// token rows.
#pragma once
#include "kivi_decode.cuh"

#ifndef KIVI_KEY_SPLIT
#define KIVI_KEY_SPLIT 1  // 0: the folded query scales in one float16 (comparisons)
#endif

namespace kivi {

__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Value scales (or zero points) of block tokens t0 and t1, every group g < GV: out[g] = half2(x[t0][g], x[t1][g]).
template <int GV>
__device__ __forceinline__ void load_pairs2(const uint8_t* base, int t0, int t1, uint32_t* out) {
  if constexpr (GV == 1) {
    const uint32_t a = *reinterpret_cast<const uint16_t*>(base + t0 * 2), b = *reinterpret_cast<const uint16_t*>(base + t1 * 2);
    out[0] = a | (b << 16);
  } else if constexpr (GV == 2) {
    const uint32_t a = *reinterpret_cast<const uint32_t*>(base + t0 * 4), b = *reinterpret_cast<const uint32_t*>(base + t1 * 4);
    out[0] = __byte_perm(a, b, 0x5410);
    out[1] = __byte_perm(a, b, 0x7632);
  } else if constexpr (GV == 4) {
    const uint2 a = *reinterpret_cast<const uint2*>(base + t0 * 8), b = *reinterpret_cast<const uint2*>(base + t1 * 8);
    out[0] = __byte_perm(a.x, b.x, 0x5410); out[1] = __byte_perm(a.x, b.x, 0x7632);
    out[2] = __byte_perm(a.y, b.y, 0x5410); out[3] = __byte_perm(a.y, b.y, 0x7632);
  } else {
    const uint4 a = *reinterpret_cast<const uint4*>(base + t0 * 16), b = *reinterpret_cast<const uint4*>(base + t1 * 16);
    out[0] = __byte_perm(a.x, b.x, 0x5410); out[1] = __byte_perm(a.x, b.x, 0x7632);
    out[2] = __byte_perm(a.y, b.y, 0x5410); out[3] = __byte_perm(a.y, b.y, 0x7632);
    out[4] = __byte_perm(a.z, b.z, 0x5410); out[5] = __byte_perm(a.z, b.z, 0x7632);
    out[6] = __byte_perm(a.w, b.w, 0x5410); out[7] = __byte_perm(a.w, b.w, 0x7632);
  }
}

// dequant<BITS, P> for a position P that is a constant after unrolling (P < U)
template <int BITS>
__device__ __forceinline__ uint32_t dequant_at(int pos, uint32_t word, uint32_t r8, uint32_t s, uint32_t z) {
  constexpr int U = 16 / BITS;
  switch (pos) {
#define KIVI_POS(P) case P: return dequant<BITS, (P < U ? P : 0)>(word, r8, s, z);
    KIVI_POS(0) KIVI_POS(1) KIVI_POS(2) KIVI_POS(3) KIVI_POS(4) KIVI_POS(5) KIVI_POS(6) KIVI_POS(7)
#undef KIVI_POS
    default: return 0u;
  }
}

// The codes of position P of both b16 halves of `word` (r8 = word >> 8) as float16 subnormals: half2
// (code_lo, code_hi) * 2^(k - 24), k the bit offset of position P in its byte, exact, one lop3 (no
// magic number, no fma).
template <int BITS, int P>
__device__ __forceinline__ uint32_t codes_subnormal(uint32_t word, uint32_t r8) {
  constexpr int pb = P * BITS;
  constexpr int k = pb >= 8 ? pb - 8 : pb;
  constexpr uint32_t one = ((1u << BITS) - 1u) << k;
  const uint32_t src = pb >= 8 ? r8 : word;
  return src & (one | (one << 16));
}
template <int BITS, int P>
__host__ __device__ constexpr float subnormal_unscale() {  // 2^(24 - k): a subnormal code's float16 value times this = the code
  constexpr int pb = P * BITS;
  return (float)(1 << (24 - (pb >= 8 ? pb - 8 : pb)));
}
template <int BITS>
__device__ __forceinline__ uint32_t codes_at(int pos, uint32_t word, uint32_t r8) {
  constexpr int U = 16 / BITS;
  switch (pos) {
#define KIVI_POS(P) case P: return codes_subnormal<BITS, (P < U ? P : 0)>(word, r8);
    KIVI_POS(0) KIVI_POS(1) KIVI_POS(2) KIVI_POS(3) KIVI_POS(4) KIVI_POS(5) KIVI_POS(6) KIVI_POS(7)
#undef KIVI_POS
    default: return 0u;
  }
}
template <int BITS>
__device__ __forceinline__ float unscale_at(int pos) {
  constexpr int U = 16 / BITS;
  switch (pos) {
#define KIVI_POS(P) case P: return subnormal_unscale<BITS, (P < U ? P : 0)>();
    KIVI_POS(0) KIVI_POS(1) KIVI_POS(2) KIVI_POS(3) KIVI_POS(4) KIVI_POS(5) KIVI_POS(6) KIVI_POS(7)
#undef KIVI_POS
    default: return 1.f;
  }
}

// FOLD (the key group holds a whole sub-block: group >= BTS): the key scales and zero points leave the
// per-element work. Per sub-block, S^T = K Q^T with K = codes * s + z per channel becomes
// codes . (s * q) + z . q: the B fragments are the queries times the channel scales (one mul.f16x2
// per fragment register), the zero term z . q is one MMA per k-step whose A rows are all the zero
// points (so its accumulator holds z . q for the lane's query columns in every row), and the codes
// enter the MMA as exact float16 subnormals (code * 2^(k - 24), one lop3 per two codes), scaled back
// in float32 with the score. Two of the three instructions per two key codes go; q * s is kept as
// hi + lo (KIVI_KEY_SPLIT), one more MMA per code fragment, for the error.
template <int D, int BITS, int SUB, int GV, int STAGES, int WARPS, int MINB, bool FOLD>
__global__ void __launch_bounds__(WARPS * 32, MINB) kivi_decode_swapped_kernel(Params p) {
  using SH = Shape<D, BITS, SUB>;
  constexpr int U = SH::U, BTS = SH::BTS, BT = SH::BT, NC = SH::NC, NCM = SH::NCM;
  constexpr int KSTEPS = D / 16;
  constexpr int MT = U / 2;  // score m-tiles per sub-block = P V k-steps; also position pairs per value chunk
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad = lane & 3, col = lane >> 2;
  const long long bh = blockIdx.y;
  const int split = blockIdx.x * WARPS + warp;
  const int lg = p.log2_group;
  const int full = min(__ldg(p.lengths), __ldg(p.lengths + 1)) / BT;
  int nblk;
  const int b0 = block_range<WARPS>(blockIdx.x, warp, full, p.splits, nblk);
  const Ring<D, BITS, SUB, GV, STAGES, true, INTERLEAVE ? WARPS : 1> ring(p, smem, warp, lane, bh, (long long)b0 * BT);
  const int nkg = ring.nkg;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nblk) ring.issue(s, s);
    cp_commit();
  }

  // B fragments of Q^T, k-step ks: query row col (head kh * G + col / Tq, token col % Tq; zero from
  // p.rows on), channels 16 ks + 2 quad, + 1 (b0) and + 8 (b1)
  uint32_t qb[KSTEPS][2];
  {
    const int kh = (int)(bh % p.hkv);
    const long long bb = bh / p.hkv;
    const bool real = col < p.rows;
    const half* src = p.q + bb * p.sq_b + (long long)(kh * p.g + (real ? col / p.tq : 0)) * p.sq_h + (real ? col % p.tq : 0) * p.sq_t + 2 * quad;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      qb[ks][0] = real ? *reinterpret_cast<const uint32_t*>(src + 16 * ks) : 0u;
      qb[ks][1] = real ? *reinterpret_cast<const uint32_t*>(src + 16 * ks + 8) : 0u;
    }
  }

  // ldmatrix row addresses of the value matrices (relative to a stage's values), per sub-block, k-step
  // mt and chunk pair mp: lane -> matrix lane / 8 (0: tokens U r + 2mt of chunk 2mp, 1: U r + 2mt + 1
  // of 2mp, 2 and 3: the same of chunk 2mp + 1), row r = lane % 8
  constexpr int MP = (NCM + 1) / 2;
  uint32_t vaddr[SUB][MT][MP];
  {
    const int r = lane & 7, mat = lane >> 3;
#pragma unroll
    for (int j = 0; j < SUB; ++j)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int mp = 0; mp < MP; ++mp) {
          const int sl = vslot<U, BTS>(j * BTS + U * r + 2 * mt + (mat & 1));
          const int chunk = NCM >= 2 ? 2 * mp + (mat >> 1) : 0;
          vaddr[j][mt][mp] = (sl * NC + vswz_t<NC>(sl, chunk)) * 16;
        }
  }

  // O^T accumulators: o[M][pp] rows g / 8 + g = channels 8U M + U g + 2pp / + 1, columns = query rows 2 quad, + 1
  float o[NCM][MT][4];
#pragma unroll
  for (int a = 0; a < NCM; ++a)
#pragma unroll
    for (int b = 0; b < MT; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[a][b][c] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // query rows 2 quad, 2 quad + 1: running max (base 2), lane-partial sums
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
      // ---- scores of sub-block j, even and odd k-steps in separate accumulators (independent MMA chains)
      float s2[2][MT][4];
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int a = 0; a < MT; ++a)
#pragma unroll
          for (int c = 0; c < 4; ++c) s2[e][a][c] = 0.f;
      const int krow = nkg > 1 ? (j * BTS + U * col) >> lg : 0;  // this lane's key group in the block
      const uint4* ksr = ksm + krow * (D / 8) + quad * (D / 32);  // this lane's D / 8 scale pairs, 4 per uint4
      const uint4* kzr = kzm + krow * (D / 8) + quad * (D / 32);
      float s[MT][4];
      if constexpr (FOLD) {  // krow is the same for every lane (group >= BTS)
        float zq[4] = {0.f, 0.f, 0.f, 0.f};  // z . q of query columns 2 quad, + 1 (every row)
#pragma unroll
        for (int h = 0; h < KSTEPS / 2; ++h) {
          uint32_t w[4];
          ldsm_x4_t(kbase + (j * D + 32 * h + lane) * 16, w[0], w[1], w[2], w[3]);
          const uint4 sv = ksr[h], zv = kzr[h];
          const uint32_t sc[4] = {sv.x, sv.y, sv.z, sv.w}, zc[4] = {zv.x, zv.y, zv.z, zv.w};
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int ks = 2 * h + e;
            const uint32_t za[4] = {zc[2 * e], zc[2 * e], zc[2 * e + 1], zc[2 * e + 1]};
            mma16816(zq, za, qb[ks][0], qb[ks][1]);
            // q * s as float16 hi + lo (lo = the rounding error of hi, itself rounded): the codes
            // multiply it uncentred (up to 2^BITS - 1 times the scale), so one rounding of q * s
            // alone about triples the error against the reference (H200, bench kivi's layers)
            const half2 q0 = u2h(qb[ks][0]), q1 = u2h(qb[ks][1]), s0 = u2h(sc[2 * e]), s1 = u2h(sc[2 * e + 1]);
            const half2 hi0 = __hmul2(q0, s0), hi1 = __hmul2(q1, s1);
            const uint32_t qs0 = h2u(hi0), qs1 = h2u(hi1);
#if KIVI_KEY_SPLIT
            const uint32_t ql0 = h2u(__hfma2(q0, s0, __hneg2(hi0))), ql1 = h2u(__hfma2(q1, s1, __hneg2(hi1)));
#endif
            const uint32_t wa = w[2 * e], wb = w[2 * e + 1];
            const uint32_t wa8 = wa >> 8, wb8 = wb >> 8;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              uint32_t a[4];
              a[0] = codes_at<BITS>(2 * mt, wa, wa8);
              a[1] = codes_at<BITS>(2 * mt + 1, wa, wa8);
              a[2] = codes_at<BITS>(2 * mt, wb, wb8);
              a[3] = codes_at<BITS>(2 * mt + 1, wb, wb8);
              mma16816(s2[e][mt], a, qs0, qs1);
#if KIVI_KEY_SPLIT
              mma16816(s2[e][mt], a, ql0, ql1);
#endif
            }
          }
        }
#pragma unroll
        for (int a = 0; a < MT; ++a) {
          const float fa = unscale_at<BITS>(2 * a), fb = unscale_at<BITS>(2 * a + 1);  // rows g, rows 8 + g
          s[a][0] = fmaf(s2[0][a][0] + s2[1][a][0], fa, zq[0]);
          s[a][1] = fmaf(s2[0][a][1] + s2[1][a][1], fa, zq[1]);
          s[a][2] = fmaf(s2[0][a][2] + s2[1][a][2], fb, zq[2]);
          s[a][3] = fmaf(s2[0][a][3] + s2[1][a][3], fb, zq[3]);
        }
      } else {
#pragma unroll
      for (int h = 0; h < KSTEPS / 2; ++h) {
        uint32_t w[4];
        ldsm_x4_t(kbase + (j * D + 32 * h + lane) * 16, w[0], w[1], w[2], w[3]);
        const uint4 sv = ksr[h], zv = kzr[h];  // pairs of matrices 4h .. 4h + 3
        const uint32_t sc[4] = {sv.x, sv.y, sv.z, sv.w}, zc[4] = {zv.x, zv.y, zv.z, zv.w};
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // k-step 2h + e: w[2e] channels + 2 quad, w[2e + 1] channels + 8 + 2 quad
          const uint32_t wa = w[2 * e], wb = w[2 * e + 1];
          const uint32_t sa = sc[2 * e], za = zc[2 * e], sb = sc[2 * e + 1], zb = zc[2 * e + 1];
          const uint32_t wa8 = wa >> 8, wb8 = wb >> 8;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t a[4];
            a[0] = dequant_at<BITS>(2 * mt, wa, wa8, sa, za);
            a[1] = dequant_at<BITS>(2 * mt + 1, wa, wa8, sa, za);
            a[2] = dequant_at<BITS>(2 * mt, wb, wb8, sb, zb);
            a[3] = dequant_at<BITS>(2 * mt + 1, wb, wb8, sb, zb);
            mma16816(s2[e][mt], a, qb[2 * h + e][0], qb[2 * h + e][1]);
          }
        }
      }
#pragma unroll
      for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[a][c] = s2[0][a][c] + s2[1][a][c];
      }
      // ---- online softmax in base 2 per query column (2 quad: c0, c2; 2 quad + 1: c1, c3); the lanes
      // of one quad value share the columns
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int a = 0; a < MT; ++a) {
        mx0 = fmaxf(mx0, fmaxf(s[a][0], s[a][2]));
        mx1 = fmaxf(mx1, fmaxf(s[a][1], s[a][3]));
      }
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      mx0 = fmaxf(m0, mx0 * sl2);
      mx1 = fmaxf(m1, mx1 * sl2);
      const float al0 = ex2(m0 - mx0), al1 = ex2(m1 - mx1);  // m = -inf at first: exp2(-inf) = 0
      m0 = mx0; m1 = mx1;
      float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
      for (int a = 0; a < MT; ++a) {
        s[a][0] = ex2(fmaf(s[a][0], sl2, -mx0)); s[a][2] = ex2(fmaf(s[a][2], sl2, -mx0));
        s[a][1] = ex2(fmaf(s[a][1], sl2, -mx1)); s[a][3] = ex2(fmaf(s[a][3], sl2, -mx1));
        ps0 += s[a][0] + s[a][2];
        ps1 += s[a][1] + s[a][3];
      }
      l0 = l0 * al0 + ps0;
      l1 = l1 * al1 + ps1;
      if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {  // the running max moved: rescale
#pragma unroll
        for (int a = 0; a < NCM; ++a)
#pragma unroll
          for (int b = 0; b < MT; ++b) {
            o[a][b][0] *= al0; o[a][b][1] *= al1; o[a][b][2] *= al0; o[a][b][3] *= al1;
          }
      }
      // ---- P V, k-step mt over the tokens of score m-tile mt
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // B = P^T: k = 2 quad, + 1 (tokens U (2 quad) + 2mt, U (2 quad + 1) + 2mt), n = query row col;
        // b1 the same of tokens + 1
        const uint32_t pb0 = movmatrix_t(pack_f2(s[mt][0], s[mt][1]));
        const uint32_t pb1 = movmatrix_t(pack_f2(s[mt][2], s[mt][3]));
        // value scales of this lane's token pairs (U 2q + p, U (2q + 1) + p) for p = 2mt (a) and 2mt + 1 (b)
        const int ta = j * BTS + U * 2 * quad + 2 * mt;
        uint32_t vsa[GV], vza[GV], vsb[GV], vzb[GV];
        load_pairs2<GV>(vsm, ta, ta + U, vsa);
        load_pairs2<GV>(vzm, ta, ta + U, vza);
        load_pairs2<GV>(vsm, ta + 1, ta + U + 1, vsb);
        load_pairs2<GV>(vzm, ta + 1, ta + U + 1, vzb);
#pragma unroll
        for (int mp = 0; mp < MP; ++mp) {
          uint32_t w[4];
          if constexpr (NCM >= 2) {
            ldsm_x4_t(vbase + vaddr[j][mt][mp], w[0], w[1], w[2], w[3]);
          } else {
            ldsm_x2_t(vbase + vaddr[j][mt][mp], w[0], w[1]);
            w[2] = w[3] = 0u;
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int M = 2 * mp + e;
            if (M >= NCM) break;
            // value group of channels 8U M + U col .. + U - 1 (this lane's unit)
            const int vg = GV <= NCM ? (M * GV) / NCM : ((8 * U * M + U * col) * GV) / D;
            const uint32_t sa = pick(vsa, vg), za = pick(vza, vg), sb = pick(vsb, vg), zb = pick(vzb, vg);
            const uint32_t wa = w[2 * e], wb = w[2 * e + 1];  // tokens of position 2mt, of 2mt + 1
            const uint32_t wa8 = wa >> 8, wb8 = wb >> 8;
#pragma unroll
            for (int pp = 0; pp < MT; ++pp) {
              uint32_t a[4];
              a[0] = dequant_at<BITS>(2 * pp, wa, wa8, sa, za);
              a[1] = dequant_at<BITS>(2 * pp + 1, wa, wa8, sa, za);
              a[2] = dequant_at<BITS>(2 * pp, wb, wb8, sb, zb);
              a[3] = dequant_at<BITS>(2 * pp + 1, wb, wb8, sb, zb);
              mma16816(o[M][pp], a, pb0, pb1);
            }
          }
        }
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_wait<0>();

  // ---- the partial: query rows 2 quad, 2 quad + 1 (if real); o[M][pp] c0 / c1 = channel 8U M + U col
  // + 2pp of rows 2 quad / 2 quad + 1, c2 / c3 = the channel after
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  const long long slot = bh * (p.splits + 1) + split;
  float* acc = p.acc + slot * 16 * p.dp;
  const int r0 = 2 * quad, r1 = 2 * quad + 1;
#pragma unroll
  for (int M = 0; M < NCM; ++M)
#pragma unroll
    for (int pp = 0; pp < MT; ++pp) {
      const int c0 = 8 * U * M + U * col + 2 * pp;
      if (r0 < p.rows) { acc[r0 * p.dp + c0] = o[M][pp][0]; acc[r0 * p.dp + c0 + 1] = o[M][pp][2]; }
      if (r1 < p.rows) { acc[r1 * p.dp + c0] = o[M][pp][1]; acc[r1 * p.dp + c0 + 1] = o[M][pp][3]; }
    }
  if (col == 0) {
    if (r0 < p.rows) { p.m[slot * 16 + r0] = m0; p.l[slot * 16 + r0] = l0; }
    if (r1 < p.rows) { p.m[slot * 16 + r1] = m1; p.l[slot * 16 + r1] = l1; }
  }
}

// dynamic shared memory of one block: WARPS rings of STAGES blocks (the queries live in registers)
template <int D, int BITS, int SUB, int GV>
int block_smem_swapped(int nkg, int stages, int warps) {
  return warps * stages * stage_bytes<D, BITS, SUB, GV>(nkg);
}

}  // namespace kivi
