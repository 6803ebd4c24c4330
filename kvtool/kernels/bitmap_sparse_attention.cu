// Bitmap decode attention, layout v2 (kvtool/kernels/bitmap_layout.py), CUDA backend of
// kvtool/kernels/bitmap_sparse_attention.py. Work follows the stored elements: every thread walks
// the set bits of its bitmap words and, per stored element, fetches the dense operand at that
// position from shared memory (keys: the query rows at the element's channel; values: the
// probabilities at the element's token), so no dense tile of the cache is ever built.
//
// One program = (KV head bh, split, chunk of NR query rows), 128 threads. It walks its layout
// blocks two at a time (128 tokens): cp.async stages the pair's bitmaps and packed elements into
// shared memory (double-buffered: pair i + 1 loads while pair i is computed), then
//   keys   (token tiles, bits along channels): thread = token; score[r] += val * q[r][channel];
//   softmax (one warp per row) turns the 128 scores into probabilities and rescales;
//   values (channel tiles, bits along tokens): thread = channel; acc[r] += val * p[r][token].
// A thread's run in the staged block starts at the exclusive prefix sum of the popcounts in
// storage order (a block-wide scan of two 16-bit counts packed in one int: both blocks at once).
// Program split == S attends the dense window. Partials (acc, m, l; base-2 scores) are merged
// by kvtool's Triton merge kernel.

#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <stdint.h>

namespace {

constexpr int THREADS = 128;
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
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] += v * src[r];
  }
}

// Walks the set bits of a 64-bit word: for each, element run[pos++] times the NR rows at
// table[(base + bit) * NR].
template <typename T, int NR>
__device__ __forceinline__ void walk(uint64_t word, const T* run, int& pos, const float* table, int base, float* acc) {
#pragma unroll
  for (int half_i = 0; half_i < 2; ++half_i) {
    unsigned w = half_i ? (unsigned)(word >> 32) : (unsigned)word;
    const int b0 = base + half_i * 32;
    while (w) {
      int bit = __ffs(w) - 1;
      w &= w - 1;
      fma_rows<NR>(acc, to_f(run[pos++]), table + (b0 + bit) * NR);
    }
  }
}

struct Params {
  const void* q; const uint64_t* kbm; const void* knz; const int64_t* koff;
  const uint64_t* vbm; const void* vnz; const int64_t* voff; const void* wk; const void* wv;
  float* acc; float* m; float* l;
  float scale_log2; int Tc, W, D, DT, NB, R, RP, DP, BPS, S, KCAP, VCAP;
};

template <typename T>
struct Smem {
  // per stage: key bits [PAIR * DT], value bits [2 * D], key elements [KCAP], value elements [VCAP]
  static __device__ __forceinline__ size_t stage_bytes(const Params& p) {
    size_t b = (size_t)PAIR * p.DT * 8 + (size_t)2 * p.D * 8;
    b += ((size_t)p.KCAP * sizeof(T) + 15) / 16 * 16 + ((size_t)p.VCAP * sizeof(T) + 15) / 16 * 16;
    return b;
  }
};

template <typename T>
__device__ __forceinline__ void stage_pair(const Params& p, char* st, int64_t bh, int blk, int nblk) {
  uint64_t* kb = reinterpret_cast<uint64_t*>(st);
  uint64_t* vb = kb + PAIR * p.DT;
  T* ks = reinterpret_cast<T*>(vb + 2 * p.D);
  T* vs = reinterpret_cast<T*>(reinterpret_cast<char*>(ks) + ((size_t)p.KCAP * sizeof(T) + 15) / 16 * 16);
  const int tok0 = blk * 64;
  const int ntok = min(nblk * 64, p.Tc - tok0);
  const uint64_t* ksrc = p.kbm + ((size_t)bh * p.Tc + tok0) * p.DT;
  for (int i = threadIdx.x; i < ntok * p.DT; i += THREADS) cp8(kb + i, ksrc + i);
  const uint64_t* vsrc = p.vbm + ((size_t)bh * p.NB + blk) * p.D;
  for (int i = threadIdx.x; i < nblk * p.D; i += THREADS) cp8(vb + i, vsrc + i);
  const int64_t g = bh * p.NB + blk;
  constexpr int EPV = 16 / sizeof(T);
  const int64_t k0 = p.koff[g], k1 = p.koff[g + nblk];
  const T* kn = reinterpret_cast<const T*>(p.knz) + k0;
  for (int i = threadIdx.x * EPV; i < (int)(k1 - k0); i += THREADS * EPV) cp16(ks + i, kn + i);
  const int64_t v0 = p.voff[g], v1 = p.voff[g + nblk];
  const T* vn = reinterpret_cast<const T*>(p.vnz) + v0;
  for (int i = threadIdx.x * EPV; i < (int)(v1 - v0); i += THREADS * EPV) cp16(vs + i, vn + i);
}

// One warp per row: scores sc[t * NR + r] (base 2, -inf = masked) -> probabilities, running
// max / sum updated, alpha[r] = rescale factor of the old accumulator.
template <int NR>
__device__ __forceinline__ void softmax_step(float* sc, float* mrow, float* lrow, float* alpha) {
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
      sc[(lane + 32 * i) * NR + r] = e;
      sum += e;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
      const float a = exp2f(m_old - m_safe);
      alpha[r] = a;
      lrow[r] = lrow[r] * a + sum;
      mrow[r] = m_new;
    }
  }
}

template <typename T, int NR, int CPT, int STAGES>
__global__ void __launch_bounds__(THREADS) bitmap_sparse_attention_kernel(Params p) {
  extern __shared__ __align__(16) char smem[];
  const int64_t bh = blockIdx.x;
  const int split = blockIdx.y;
  const int r0 = blockIdx.z * NR;
  const int tid = threadIdx.x;
  float* qs = reinterpret_cast<float*>(smem);            // [D][NR], scaled by scale * log2(e)
  float* sc = qs + p.D * NR;                              // [PAIR][NR] scores, then probabilities
  float* mrow = sc + PAIR * NR;                           // [NR]
  float* lrow = mrow + NR;
  float* alpha = lrow + NR;
  int* scratch = reinterpret_cast<int*>(alpha + NR);      // [8]
  char* stages = smem + (((size_t)(p.D * NR + PAIR * NR + 3 * NR + 8) * 4 + 15) / 16 * 16);
  const size_t stage_bytes = Smem<T>::stage_bytes(p);

  const T* q = reinterpret_cast<const T*>(p.q);
  for (int i = tid; i < p.D * NR; i += THREADS) {
    const int c = i / NR, r = i % NR;
    qs[i] = r0 + r < p.R ? to_f(q[(bh * p.R + r0 + r) * p.D + c]) * p.scale_log2 : 0.f;
  }
  if (tid < NR) { mrow[tid] = -INFINITY; lrow[tid] = 0.f; }
  float acc[CPT][NR];
#pragma unroll
  for (int i = 0; i < CPT; ++i)
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[i][r] = 0.f;

  if (split < p.S) {
    const int b0 = split * p.BPS;
    const int b1 = min(p.NB, b0 + p.BPS);
    if (b0 < b1) stage_pair<T>(p, stages, bh, b0, min(2, b1 - b0));
    cp_commit();
    int it = 0;
    for (int blk = b0; blk < b1; blk += 2, ++it) {
      const int nblk = min(2, b1 - blk);
      char* st = stages + (STAGES == 2 ? (it & 1) * stage_bytes : 0);
      if (STAGES == 2) {
        if (blk + 2 < b1) stage_pair<T>(p, stages + ((it + 1) & 1) * stage_bytes, bh, blk + 2, min(2, b1 - blk - 2));
        cp_commit();
        cp_wait_one();
      } else {
        if (it > 0) {
          stage_pair<T>(p, stages, bh, blk, nblk);
          cp_commit();
        }
        cp_wait_all();
      }
      __syncthreads();
      const uint64_t* kb = reinterpret_cast<const uint64_t*>(st);
      const uint64_t* vb = kb + PAIR * p.DT;
      const T* ks = reinterpret_cast<const T*>(vb + 2 * p.D);
      const T* vs = reinterpret_cast<const T*>(reinterpret_cast<const char*>(ks) + ((size_t)p.KCAP * sizeof(T) + 15) / 16 * 16);
      const int tok0 = blk * 64;
      const int ntok = min(nblk * 64, p.Tc - tok0);
      // keys: thread = token of the pair; its run starts after the earlier tokens of its block
      const bool has_tok = tid < ntok;
      int cnt = 0;
      if (has_tok)
        for (int i = 0; i < p.DT; ++i) cnt += __popcll(kb[tid * p.DT + i]);
      int total;
      const int packed = block_excl_scan(tid < 64 ? cnt : cnt << 16, scratch, &total);
      int pos = tid < 64 ? (packed & 0xffff) : (packed >> 16) + (int)(p.koff[bh * p.NB + blk + 1] - p.koff[bh * p.NB + blk]);
      float s[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) s[r] = 0.f;
      if (has_tok)
        for (int i = 0; i < p.DT; ++i) walk<T, NR>(kb[tid * p.DT + i], ks, pos, qs, i * 64, s);
#pragma unroll
      for (int r = 0; r < NR; ++r) sc[tid * NR + r] = has_tok ? s[r] : -INFINITY;
      __syncthreads();
      softmax_step<NR>(sc, mrow, lrow, alpha);
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
      const int vpacked = block_excl_scan(vc, scratch, &total);
      int p0 = vpacked & 0xffff;
      int p1 = (vpacked >> 16) + (int)(p.voff[bh * p.NB + blk + 1] - p.voff[bh * p.NB + blk]);
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[i][r] *= alpha[r];
        walk<T, NR>(w0[i], vs, p0, sc, 0, acc[i]);
        walk<T, NR>(w1[i], vs, p1, sc, 64, acc[i]);
      }
      __syncthreads();
    }
    cp_wait_all();
  } else {
    const T* wk = reinterpret_cast<const T*>(p.wk);
    const T* wv = reinterpret_cast<const T*>(p.wv);
    __syncthreads();
    for (int w0 = 0; w0 < p.W; w0 += PAIR) {
      const int t = w0 + tid;
      float s[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) s[r] = 0.f;
      if (t < p.W)
        for (int c = 0; c < p.D; ++c) fma_rows<NR>(s, to_f(wk[(bh * p.W + t) * p.D + c]), qs + c * NR);
#pragma unroll
      for (int r = 0; r < NR; ++r) sc[tid * NR + r] = t < p.W ? s[r] : -INFINITY;
      __syncthreads();
      softmax_step<NR>(sc, mrow, lrow, alpha);
      __syncthreads();
      const int n = min(PAIR, p.W - w0);
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
        const int c = tid * CPT + i;
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[i][r] *= alpha[r];
        if (c < p.D)
          for (int j = 0; j < n; ++j) fma_rows<NR>(acc[i], to_f(wv[(bh * p.W + w0 + j) * p.D + c]), sc + j * NR);
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

template <typename T, int NR, int CPT, int STAGES>
void launch(const Params& p, dim3 grid, size_t smem, cudaStream_t stream) {
  auto kern = bitmap_sparse_attention_kernel<T, NR, CPT, STAGES>;
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kern<<<grid, THREADS, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int CPT, int STAGES>
void dispatch_nr(const Params& p, int nr, dim3 grid, size_t smem, cudaStream_t s) {
  switch (nr) {
    case 1: launch<T, 1, CPT, STAGES>(p, grid, smem, s); break;
    case 2: launch<T, 2, CPT, STAGES>(p, grid, smem, s); break;
    case 4: launch<T, 4, CPT, STAGES>(p, grid, smem, s); break;
    default: launch<T, 8, CPT, STAGES>(p, grid, smem, s); break;
  }
}

template <typename T>
void dispatch(const Params& p, int nr, int cpt, int stages, dim3 grid, size_t smem, cudaStream_t s) {
  if (cpt == 1) {
    if (stages == 2) dispatch_nr<T, 1, 2>(p, nr, grid, smem, s); else dispatch_nr<T, 1, 1>(p, nr, grid, smem, s);
  } else {
    if (stages == 2) dispatch_nr<T, 2, 2>(p, nr, grid, smem, s); else dispatch_nr<T, 2, 1>(p, nr, grid, smem, s);
  }
}

}  // namespace

// q [BH, R, D]; kbm int64 [BH, Tc, DT]; vbm int64 [BH, NB, D]; offsets int64; window [BH, W, D];
// acc float [BH, S+1, RP, DP]; m, l float [BH, S+1, RP]. nr in {1, 2, 4, 8}: rows per program.
void bitmap_sparse_attention(torch::Tensor q, torch::Tensor kbm, torch::Tensor knz, torch::Tensor koff,
                             torch::Tensor vbm, torch::Tensor vnz, torch::Tensor voff, torch::Tensor wk, torch::Tensor wv,
                             torch::Tensor acc, torch::Tensor m, torch::Tensor l, double scale_log2,
                             int64_t Tc, int64_t W, int64_t NB, int64_t BPS, int64_t S, int64_t kcap, int64_t vcap,
                             int64_t nr, int64_t stages) {
  Params p;
  p.q = q.data_ptr(); p.kbm = reinterpret_cast<const uint64_t*>(kbm.data_ptr()); p.knz = knz.data_ptr();
  p.koff = koff.data_ptr<int64_t>(); p.vbm = reinterpret_cast<const uint64_t*>(vbm.data_ptr()); p.vnz = vnz.data_ptr();
  p.voff = voff.data_ptr<int64_t>(); p.wk = wk.data_ptr(); p.wv = wv.data_ptr();
  p.acc = acc.data_ptr<float>(); p.m = m.data_ptr<float>(); p.l = l.data_ptr<float>();
  p.scale_log2 = (float)scale_log2;
  p.Tc = (int)Tc; p.W = (int)W; p.D = (int)q.size(2); p.DT = (p.D + 63) / 64; p.NB = (int)NB; p.R = (int)q.size(1);
  p.RP = (int)acc.size(2); p.DP = (int)acc.size(3); p.BPS = (int)BPS; p.S = (int)S;
  p.KCAP = (int)kcap; p.VCAP = (int)vcap;
  const int cpt = p.D <= THREADS ? 1 : 2;
  const int bh = (int)q.size(0);
  dim3 grid(bh, p.S + 1, (p.R + nr - 1) / nr);
  size_t head = ((size_t)(p.D * nr + PAIR * nr + 3 * nr + 8) * 4 + 15) / 16 * 16;
  const size_t esz = q.element_size();
  size_t stage = (size_t)PAIR * p.DT * 8 + (size_t)2 * p.D * 8 + (p.KCAP * esz + 15) / 16 * 16 + (p.VCAP * esz + 15) / 16 * 16;
  size_t smem = head + stage * (stages == 2 ? 2 : 1);
  cudaStream_t s = at::cuda::getCurrentCUDAStream();
  if (q.scalar_type() == at::kHalf) dispatch<half>(p, (int)nr, cpt, (int)stages, grid, smem, s);
  else if (q.scalar_type() == at::kBFloat16) dispatch<__nv_bfloat16>(p, (int)nr, cpt, (int)stages, grid, smem, s);
  else dispatch<float>(p, (int)nr, cpt, (int)stages, grid, smem, s);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bitmap_sparse_attention", &bitmap_sparse_attention, "bitmap decode attention, layout v2 (partials)");
}
