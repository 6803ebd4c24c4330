// Tensor-core walk of the bitmap decode attention (WALK_MMA; head_dim D = 64 or 128, 16-bit caches):
// each thread expands the stored elements of its own bitmap bits, four dense elements (a nibble) at
// a time, straight into the A operand of an mma.m16n8k16, so that the products run on the tensor
// cores and a dense element costs the same few instructions whatever the density.
//
// Fragments (g = lane / 4, q = lane % 4): the A operand's rows are the expanded rows (keys: 16
// tokens; values: 16 channels), B holds the dense operand (q^T; P^T), N = 8 query rows. Thread q
// holds the reduced-axis positions {2q, 2q+1, 2q+8, 2q+9} of each k-step, and that axis may be
// ordered at will: k-step s of thread q is nibble s of its quarter of the row's bits (keys: channels
// D/4 q + 4s .. + 3 of a token, D/16 k-steps; values: tokens 32q + 4s .. + 3 of a channel in the
// pair of blocks, 8 k-steps). Probabilities pass through shared memory in the B operand's fragment
// order. A warp's channels of P.V are D/4: D/64 m-tiles of 16.
#pragma once

namespace bsa {

template <typename T>
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  if constexpr (std::is_same<T, half>::value)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// byte_perm selector placing, for the two bits m of a dense pair, the first stored halves of its
// source where bits are set and zero (source bytes 4..7) where they are clear.
__host__ __device__ constexpr unsigned pair_selector(unsigned m) {
  return m == 0 ? 0x4444u : m == 1 ? 0x4410u : m == 2 ? 0x1044u : 0x3210u;
}
__host__ __device__ constexpr unsigned popc2(unsigned m) { return (m & 1u) + ((m >> 1) & 1u); }

// The nibble table: for bits e, x = pair selector of bits 0-1 | (16 * their popcount) << 16 (prmt
// reads only the low 16 bits of its selector), y = pair selector of bits 2-3.
__device__ __forceinline__ void fill_nibble_table(uint2* lut) {
  if (threadIdx.x < 16) {
    const unsigned e = threadIdx.x;
    lut[e] = make_uint2(pair_selector(e & 3u) | (popc2(e & 3u) << 20), pair_selector(e >> 2));
  }
}

// The four bytes of {hi:lo} from byte (c & 3) on: a funnel shift by whole bytes.
__device__ __forceinline__ unsigned bytes_from(unsigned lo, unsigned hi, unsigned c) {
  unsigned d;
  asm("prmt.b32.f4e %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(c));
  return d;
}

// Four dense elements (lo: elements 0, 1; hi: 2, 3) of a nibble from the eight bytes x0, x1 that
// start at its first stored element; sel = its table entry.
__device__ __forceinline__ void select4(unsigned x0, unsigned x1, uint2 sel, unsigned& lo, unsigned& hi) {
  lo = prmt(x0, 0u, sel.x);
  const unsigned z = __funnelshift_rc(x0, x1, sel.x >> 16);  // from the third bit's element
  hi = prmt(z, 0u, sel.y);
}

// Four dense elements of a nibble whose stored elements are the shared bytes [a, end). At most
// three 32-bit loads, one per word the run touches. A word the run does not touch is not read: its
// register keeps a dead value (the byte count, the address), whose bytes the selectors never pick,
// so that no instruction zeroes it.
__device__ __forceinline__ void expand4(unsigned a, unsigned end, uint2 sel, unsigned& lo, unsigned& hi) {
  const unsigned base = a & ~3u;
  unsigned w0, w1 = end - base, w2 = base;  // w1: the bytes needed from base
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w0) : "r"(base));  // most nibbles need it: no predicate
  asm volatile("{ .reg .pred p, q; setp.gt.u32 p, %0, 4; setp.gt.u32 q, %0, 8;\n"
               " @p ld.shared.b32 %0, [%1+4]; @q ld.shared.b32 %1, [%1+8]; }" : "+r"(w1), "+r"(w2));
  select4(bytes_from(w0, w1, a), bytes_from(w1, w2, a), sel, lo, hi);
}

// Nibble s of bitmap word w: its stored elements (n) and its selector-table entry. A table load
// (selectors by ALU were 16% slower); the byte offset of entry m >> 4s is m shifted by one instruction.
__device__ __forceinline__ uint2 nibble_entry(unsigned w, int s, const uint2* lut, unsigned& n) {
  const unsigned m = w & (15u << (4 * s));  // the nibble in place
  n = __popc(m);
  return *reinterpret_cast<const uint2*>(reinterpret_cast<const char*>(lut) + (s == 0 ? m << 3 : m >> (4 * s - 3)));
}

// Walks the nibbles of one bitmap word: k-step s gives the dense elements 4s .. 4s + 3.
struct WordWalk {
  unsigned w, a;  // bits, shared byte address of the next stored element
  __device__ __forceinline__ void step(int s, const uint2* lut, unsigned& lo, unsigned& hi) {
    unsigned n;
    const uint2 sel = nibble_entry(w, s, lut, n);
    expand4(a, a + 2u * n, sel, lo, hi);
    a += 2u * n;
  }
};

// The same walk through a two-word buffer of the run (r0, r1: the words at a & ~3 and the next),
// so that each staged word is read once per walk instead of once per nibble that touches it: 20%
// fewer shared-memory requests for more instructions, a gain where the stage is dense (BUFFERED).
struct BufferedWalk {
  unsigned w, a;  // bits, shared byte address of the next stored element
  unsigned r0, r1;
  __device__ __forceinline__ void step(int s, const uint2* lut, unsigned& lo, unsigned& hi) {
    if (s == 0)
      asm volatile("ld.shared.b32 %0, [%2]; ld.shared.b32 %1, [%2+4];" : "=r"(r0), "=r"(r1) : "r"(a & ~3u));
    unsigned n;
    const uint2 sel = nibble_entry(w, s, lut, n);
    const unsigned t = (a & 3u) + 2u * n;  // bytes the nibble needs from the buffer's first word
    unsigned r2 = a;  // the third word, read only when needed: a dead value otherwise, never selected
    asm volatile("{ .reg .pred p; setp.ge.u32 p, %1, 8; @p ld.shared.b32 %0, [%2+8]; }" : "+r"(r2) : "r"(t), "r"(a & ~3u));
    select4(bytes_from(r0, r1, a), bytes_from(r1, r2, a), sel, lo, hi);
    a += 2u * n;
    if (s < 7) {  // slide the buffer to the word of the next element
      r0 = t >= 8 ? r2 : t >= 4 ? r1 : r0;
      asm volatile("{ .reg .pred p; setp.ge.u32 p, %1, 4; @p ld.shared.b32 %0, [%2+4]; }" : "+r"(r1) : "r"(t), "r"(a & ~3u));
    }
  }
};

// Bulk staging (BULK, sm_90: cp.async.bulk): one thread requests a pair's half as two copies (bits,
// elements) that complete on that half's mbarrier, in place of 14 cp.async per thread and their
// address arithmetic (9% of the instructions). Short launches keep cp.async, whose loads land
// sooner (bitmap_sparse_attention.py: use_bulk_copies); older GPUs have no bulk copies.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BSA_BULK 1
#else
#define BSA_BULK 0
#endif

__device__ __forceinline__ unsigned smem_u32(const void* ptr) { return (unsigned)__cvta_generic_to_shared(ptr); }

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
#if BSA_BULK
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
#endif
}

// Waits until the mbarrier's phase of the given parity has completed. Progress: the phase completes
// once its one arrival (the expect_tx of stage_half_bulk) has come and its transaction count is back
// at zero, i.e. every byte that expect_tx announced has landed. stage_half_bulk announces exactly the
// bytes of the copies it issues, each a multiple of 16 bytes from and to 16-byte aligned addresses
// (cp.async.bulk's unit: a copy of another size is invalid, and a phase whose announced bytes do not
// all land never completes: at head_dim 64 a 127-token tail asked for 1016 bytes of key bits, the
// H200 hang of issue 44); and a phase is waited on only after it was
// requested (same nblk > 0 test on both sides). The parity cannot alias a later phase: the next
// request on this bar is issued after a __syncthreads() that every waiter reaches only after its wait.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if BSA_BULK
  unsigned done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  } while (!done);
#endif
}

// A pair's key part (KEYS) or value part, bits and packed elements [e0, e1), requested by the
// calling thread alone; the bar's phase completes when both copies have landed. Sizes and
// addresses are multiples of 16 bytes (mbar_wait's invariant): value bits are whole 64-channel rows
// (512 bytes a block at head_dim 64), block runs are padded to 8 elements, and a KV head's key bits
// span a multiple of 16 bytes (TCS * DT even: the host takes cp.async otherwise, see
// bitmap_sparse_attention.cu), so a pair's key bits start on 16 bytes; at head_dim 64 a key row is 8
// bytes, and a tail of an odd number of tokens copies one row more (row tok0 + ntok < TCS, since
// tok0 + ntok is odd and TCS even: inside the KV head's bits; never read as a token).
template <typename T, bool KEYS>
__device__ __forceinline__ void stage_half_bulk(const Params& p, char* st, int64_t bh, int blk, int nblk, int64_t e0, int64_t e1, uint64_t* bar) {
#if BSA_BULK
  const Stage<T> L(p);
  const void* bsrc;
  unsigned bbytes;
  if (KEYS) {
    const int tok0 = blk * 64;
    bsrc = p.kbm + ((size_t)bh * p.TCS + tok0) * p.DT;
    bbytes = ((unsigned)min(nblk * 64, p.Tc - tok0) * p.DT * 8u + 15u) & ~15u;
  } else {
    bsrc = p.vbm + ((size_t)bh * p.NBS + blk) * p.D;
    bbytes = (unsigned)(nblk * p.D) * 8u;
  }
  const unsigned ebytes = (unsigned)(e1 - e0) * (unsigned)sizeof(T);
  const T* esrc = reinterpret_cast<const T*>(KEYS ? p.knz : p.vnz) + e0;
  const unsigned b = smem_u32(bar);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // after the generic reads of the old stage
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bbytes + ebytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(st + (KEYS ? 0 : L.vb))), "l"(bsrc), "r"(bbytes), "r"(b) : "memory");
  if (ebytes)
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(st + (KEYS ? L.ks : L.vs))), "l"(esrc), "r"(ebytes), "r"(b) : "memory");
#endif
}

// A pair's half (nblk blocks from blk; none when nblk is 0) staged by every thread as one cp.async
// load group (committed even when empty, so that waits count groups) or, BULK, by thread 0 onto bar.
template <typename T, bool KEYS, bool BULK>
__device__ __forceinline__ void request_half(const Params& p, char* st, int64_t bh, int blk, int nblk, int64_t e0, int64_t e1, uint64_t* bar) {
  if constexpr (BULK && BSA_BULK) {
    if (threadIdx.x == 0 && nblk > 0) stage_half_bulk<T, KEYS>(p, st, bh, blk, nblk, e0, e1, bar);
  } else {
    if (nblk > 0) stage_half<T, KEYS>(p, st, bh, blk, nblk, e0, e1);
    cp_commit();
  }
}

// Waits for the half requested on bar (phase parity) or for all but the newest load group.
template <bool BULK>
__device__ __forceinline__ void await_half(uint64_t* bar, unsigned parity) {
  if constexpr (BULK && BSA_BULK) mbar_wait(bar, parity);
  else cp_wait_one();
}

constexpr int MMA_ROWS = 8;  // query rows per program (the mma's N)

// Shared memory ahead of the stage: P^T fragments ushort [8 s][32 lanes][4], head maxima / sums
// float [4 warps][8], nibble table uint2 [16], scan scratch int [8], key run starts int [128][4],
// key words [128][4], value run starts int [128][4], with bulk staging the keys' and values'
// mbarriers uint64 [2].
__host__ __device__ constexpr size_t mma_head_bytes(bool bulk) {
  return (size_t)8 * 32 * 8 + 4 * MMA_ROWS * 4 + 16 * 8 + 8 * 4 + 3 * PAIR * 4 * 4 + (bulk ? 2 * 8 : 0);
}

// The P^T fragment slot of B-operand lane L at k-step s (SWIZZLE): a permutation of the 32 lanes (the
// loads of a k-step stay one contiguous 256 bytes) under which the 16-bit stores of the softmax, which
// write eight tokens x four heads per instruction, land on 16 different banks instead of 4. Taken by
// the bulk-staged word walk, which it speeds up by 2%; the other walks were measured slower with it.
template <bool SWIZZLE>
__device__ __forceinline__ int pfrag_slot(int lane, int s) { return SWIZZLE ? lane ^ ((lane >> 4) << 2) ^ (s & 1) : lane; }

// The running state of the query rows (heads) 2q, 2q + 1 that a thread's fragments hold.
struct MmaRows {
  float m[2] = {-INFINITY, -INFINITY};  // running max (base 2), equal in all threads
  float l[2] = {0.f, 0.f};              // this thread's share of the running sum
};

// One 128-token tile: S^T = K q^T over the warp's 32 tokens (m-tiles mt: tokens 32 warp + 16 mt +
// row; KS = D / 16 k-steps), softmax across warps, O^T += V^T P^T over the warp's D / 4 channels (VMT
// = D / 64 m-tiles). kf(mt, half, s, lo, hi): A operand rows g (half 0) and g + 8 (half 1) of key
// m-tile mt at k-step s; vf likewise for the value m-tiles (channels D/4 warp + 16 mt + row).
// valid(t): token t of the tile is attended. issue() runs after the barrier that ends every warp's
// use of the key stage, ready() before the values (it must end with a barrier).
template <typename T, bool SWIZZLE, int KS, int VMT, typename KF, typename VF, typename VALID, typename ISSUE, typename READY>
__device__ __forceinline__ void mma_tile(const unsigned (&qb)[KS][2], float scale_log2, MmaRows& st, float (&o)[VMT][4],
                                         float* red, unsigned short* pfrag, KF kf, VF vf, VALID valid, ISSUE issue, READY ready) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  float sc[2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[mt][i] = 0.f;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      unsigned a[4];
      kf(mt, 0, s, a[0], a[2]);
      kf(mt, 1, s, a[1], a[3]);
      mma16816<T>(sc[mt], a, qb[s][0], qb[s][1]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // c0, c1: token row g, heads 2q, 2q + 1; c2, c3: row g + 8
      const int t = 32 * warp + 16 * mt + g + 8 * (i >> 1);
      sc[mt][i] = valid(t) ? sc[mt][i] * scale_log2 : -INFINITY;
    }
  }
  float mx[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(fmaxf(sc[0][h], sc[0][h + 2]), fmaxf(sc[1][h], sc[1][h + 2]));
#pragma unroll
    for (int o2 = 4; o2 < 32; o2 <<= 1) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], o2));
  }
  if (g == 0) { red[warp * MMA_ROWS + 2 * q] = mx[0]; red[warp * MMA_ROWS + 2 * q + 1] = mx[1]; }
  __syncthreads();
  issue();
  float ms[2], alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mn = st.m[h];
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) mn = fmaxf(mn, red[w * MMA_ROWS + 2 * q + h]);
    ms[h] = mn == -INFINITY ? 0.f : mn;
    alpha[h] = exp2f(st.m[h] - ms[h]);
    st.m[h] = mn;
    st.l[h] *= alpha[h];
  }
  // P^T in the B operand's fragment order: token t = 32 warp + 4 s + i of head h -> pfrag[s][slot(4 h + warp, s)][i]
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = i & 1;
      const float pv = exp2f(sc[mt][i] - ms[h]);
      st.l[h] += pv;
      const int tt = 16 * mt + g + 8 * (i >> 1);  // token within the warp's 32
      pfrag[((tt >> 2) * 32 + pfrag_slot<SWIZZLE>(4 * (2 * q + h) + warp, tt >> 2)) * 4 + (tt & 3)] = f_to_bits<T>(pv);
    }
#pragma unroll
  for (int mt = 0; mt < VMT; ++mt) {
    o[mt][0] *= alpha[0]; o[mt][1] *= alpha[1];
    o[mt][2] *= alpha[0]; o[mt][3] *= alpha[1];
  }
  ready();
  const uint2* pf = reinterpret_cast<const uint2*>(pfrag);
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const uint2 b = pf[s * 32 + pfrag_slot<SWIZZLE>(lane, s)];
#pragma unroll
    for (int mt = 0; mt < VMT; ++mt) {
      unsigned a[4];
      vf(mt, 0, s, a[0], a[2]);
      vf(mt, 1, s, a[1], a[3]);
      mma16816<T>(o[mt], a, b.x, b.y);
    }
  }
}

template <typename T, int D, bool BULK, bool BUFFERED>
__global__ void __launch_bounds__(THREADS) bitmap_sparse_attention_mma_kernel(Params pin) {
  static_assert(D == 64 || D == 128, "the tensor-core walk serves head_dim 64 and 128");
  constexpr int KS = D / 16;      // k-steps of q.K^T
  constexpr int VMT = D / 64;     // P.V m-tiles per warp (D / 4 channels)
  constexpr int QW = D / 128;     // key words per lane quarter, 0 when a quarter is half a word
  extern __shared__ __align__(16) char smem[];
  Params p = pin;
  resolve_lengths(p);
  const int64_t bh = blockIdx.x;
  const int split = blockIdx.y;
  const int r0 = blockIdx.z * MMA_ROWS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  unsigned short* pfrag = reinterpret_cast<unsigned short*>(smem);
  float* red = reinterpret_cast<float*>(pfrag + 8 * 32 * 4);
  uint2* lut = reinterpret_cast<uint2*>(red + 4 * MMA_ROWS);
  int* scratch = reinterpret_cast<int*>(lut + 16);
  int* kst = scratch + 8;
  unsigned* kwd = reinterpret_cast<unsigned*>(kst + PAIR * 4);
  int* vst = reinterpret_cast<int*>(kwd + PAIR * 4);
  uint64_t* bars = reinterpret_cast<uint64_t*>(vst + PAIR * 4);  // keys, values
  char* st = smem + mma_head_bytes(BULK);
  const Stage<T> L(p);

  // the split's blocks [b0, b1) (none for the window program), its first pair requested at once
  int b0, b1;
  if constexpr (BULK && BSA_BULK) {
    const int2 range = split_blocks(p, split);
    b0 = range.x;
    b1 = range.y;
    if (tid == 0) {
      mbar_init(&bars[0]);
      mbar_init(&bars[1]);
      if (b0 < b1) {
        const int n = min(2, b1 - b0);
        const int64_t g = bh * p.NBS + b0;
        stage_half_bulk<T, true>(p, st, bh, b0, n, p.koff[g], p.koff[g + n], &bars[0]);
        stage_half_bulk<T, false>(p, st, bh, b0, n, p.voff[g], p.voff[g + n], &bars[1]);
      }
    }
  } else {
    const int2 range = stage_first_pair<T>(p, st, bh, split);
    b0 = range.x;
    b1 = range.y;
  }
  fill_nibble_table(lut);

  // q^T fragments: query row g, channels D/4 q + 4 s .. + 3 for k-step s
  unsigned qb[KS][2];
  {
    const int r = r0 + g;
    uint4 x[KS / 2];
    const T* qr = reinterpret_cast<const T*>(p.q) + ((size_t)bh * p.R + r) * D + (D / 4) * q;
#pragma unroll
    for (int i = 0; i < KS / 2; ++i) x[i] = r < p.R ? reinterpret_cast<const uint4*>(qr)[i] : make_uint4(0u, 0u, 0u, 0u);
    const unsigned* xw = reinterpret_cast<const unsigned*>(x);
#pragma unroll
    for (int s = 0; s < KS; ++s) { qb[s][0] = xw[2 * s]; qb[s][1] = xw[2 * s + 1]; }
  }
  MmaRows rows;
  float o[VMT][4];
#pragma unroll
  for (int mt = 0; mt < VMT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[mt][i] = 0.f;

  if (split < p.S) {
    // the mbarriers' initialisation, visible to every waiter (the copies' complete_tx see it through
    // the proxy fence in stage_half_bulk, issued by the initialising thread after the init)
    if constexpr (BULK && BSA_BULK) __syncthreads();
    unsigned parity = 0;
    for (int blk = b0; blk < b1; blk += 2, parity ^= 1u) {
      const int nblk = min(2, b1 - blk);
      const int nnext = min(2, b1 - blk - 2);
      int64_t next[4] = {0, 0, 0, 0};  // the next pair's key and value runs, loaded while this pair waits
      if (nnext > 0) {
        const int64_t g = bh * p.NBS + blk + 2;
        next[0] = p.koff[g]; next[1] = p.koff[g + nnext]; next[2] = p.voff[g]; next[3] = p.voff[g + nnext];
      }
      const int2 second = second_starts(p, bh, blk, nblk);
      // this pair's keys: requested before the loop (first pair) or in the previous iteration's issue()
      // with nnext > 0, which is this iteration's nblk > 0; bar phase = pair index, hence parity
      await_half<BULK>(&bars[0], parity);
      __syncthreads();
      const int ntok = min(nblk * 64, p.Tc - blk * 64);
      {  // key rows: thread = token; run starts of its four quarters (a word each at D = 128)
        const unsigned* kb = reinterpret_cast<const unsigned*>(st);
        const bool has = tid < ntok;
        constexpr int NW = D / 32;  // 32-bit words per key row
        unsigned h[NW];
        int cnt = 0;
#pragma unroll
        for (int i = 0; i < NW; ++i) { h[i] = has ? kb[tid * NW + i] : 0u; cnt += __popc(h[i]); }
        const int2 starts = pair_run_starts(tid < 64 ? cnt : cnt << 16, scratch, second.x);
        int pos = tid < 64 ? starts.x : starts.y;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const unsigned quarter = QW ? h[i] : (h[i >> 1] >> (16 * (i & 1))) & 0xffffu;
          kst[tid * 4 + i] = pos;
          kwd[tid * 4 + i] = quarter;
          pos += __popc(quarter);
        }
      }
      __syncthreads();
      const unsigned ksa = (unsigned)__cvta_generic_to_shared(st + L.ks);
      const unsigned vsa = (unsigned)__cvta_generic_to_shared(st + L.vs);
      std::conditional_t<BUFFERED, BufferedWalk, WordWalk> kw[2][2], vw[VMT][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int t = 32 * warp + 16 * mt + 8 * hf + g;
          kw[mt][hf].w = kwd[t * 4 + q];
          kw[mt][hf].a = ksa + 2u * kst[t * 4 + q];
        }
      const uint64_t* vb = reinterpret_cast<const uint64_t*>(st + L.vb);
      mma_tile<T, BULK && !BUFFERED, KS, VMT>(qb, p.scale_log2, rows, o, red, pfrag,
          [&](int mt, int hf, int s, unsigned& lo, unsigned& hi) { kw[mt][hf].step(s, lut, lo, hi); },
          [&](int mt, int hf, int s, unsigned& lo, unsigned& hi) { vw[mt][hf].step(s, lut, lo, hi); },
          [&](int t) { return t < ntok; },
          [&] {
            request_half<T, true, BULK>(p, st, bh, blk + 2, max(nnext, 0), next[0], next[1], &bars[0]);  // key part free: next keys
          },
          [&] {
            // this pair's values: requested before the loop or after the previous iteration's last
            // barrier (same nnext test as for the keys)
            await_half<BULK>(&bars[1], parity);
            __syncthreads();
            {  // value tiles: thread = channel; run starts of its four 32-token words
              const bool has = tid < D;
              const uint64_t x0 = has ? vb[tid] : 0, x1 = has && nblk > 1 ? vb[D + tid] : 0;
              const int2 starts = pair_run_starts(__popcll(x0) + (__popcll(x1) << 16), scratch, second.y);
              const int p0 = starts.x, p1 = starts.y;
              if (has) {
                vst[tid * 4 + 0] = p0;
                vst[tid * 4 + 1] = p0 + __popc((unsigned)x0);
                vst[tid * 4 + 2] = p1;
                vst[tid * 4 + 3] = p1 + __popc((unsigned)x1);
              }
            }
            __syncthreads();
            const unsigned* vb32 = reinterpret_cast<const unsigned*>(vb);
#pragma unroll
            for (int mt = 0; mt < VMT; ++mt)
#pragma unroll
              for (int hf = 0; hf < 2; ++hf) {
                const int d = (D / 4) * warp + 16 * mt + 8 * hf + g;
                vw[mt][hf].w = (q < 2 || nblk > 1) ? vb32[(q >> 1) * 2 * D + 2 * d + (q & 1)] : 0u;
                vw[mt][hf].a = vsa + 2u * vst[d * 4 + q];
              }
          });
      __syncthreads();
      request_half<T, false, BULK>(p, st, bh, blk + 2, max(nnext, 0), next[2], next[3], &bars[1]);
    }
    // nothing in flight at exit: the last pair requested nothing (nnext <= 0), and cp.async groups are drained
    cp_wait_all();
  } else {
    const T* wk = reinterpret_cast<const T*>(p.wk) + (size_t)bh * p.WS * D;
    const unsigned short* wv = reinterpret_cast<const unsigned short*>(p.wv) + (size_t)bh * p.WS * D;
    __syncthreads();  // the nibble table (unused here) and a clean start
    for (int w0 = 0; w0 < p.W; w0 += PAIR) {
      mma_tile<T, BULK && !BUFFERED, KS, VMT>(qb, p.scale_log2, rows, o, red, pfrag,
          [&](int mt, int hf, int s, unsigned& lo, unsigned& hi) {
            const int t = w0 + 32 * warp + 16 * mt + 8 * hf + g;
            const uint2 x = t < p.W ? *reinterpret_cast<const uint2*>(wk + (size_t)t * D + (D / 4) * q + 4 * s) : make_uint2(0u, 0u);
            lo = x.x; hi = x.y;
          },
          [&](int mt, int hf, int s, unsigned& lo, unsigned& hi) {
            const int d = (D / 4) * warp + 16 * mt + 8 * hf + g;
            unsigned e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int t = w0 + 32 * q + 4 * s + i;
              e[i] = t < p.W ? wv[(size_t)t * D + d] : 0u;
            }
            lo = e[0] | (e[1] << 16);
            hi = e[2] | (e[3] << 16);
          },
          [&](int t) { return w0 + t < p.W; }, [] {}, [] { __syncthreads(); });
      __syncthreads();
    }
  }
  // the sums: the thread's share -> the eight token rows of its warp -> the four warps
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int o2 = 4; o2 < 32; o2 <<= 1) rows.l[h] += __shfl_xor_sync(0xffffffffu, rows.l[h], o2);
  __syncthreads();
  if (g == 0) { red[warp * MMA_ROWS + 2 * q] = rows.l[0]; red[warp * MMA_ROWS + 2 * q + 1] = rows.l[1]; }
  __syncthreads();
  const int64_t slot = bh * (p.S + 1) + split;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 2 * q + h;
    if (r >= p.R) continue;
    float* dst = p.acc + (slot * p.RP + r) * p.DP + (D / 4) * warp + g;
#pragma unroll
    for (int mt = 0; mt < VMT; ++mt) {
      dst[16 * mt] = o[mt][h];
      dst[16 * mt + 8] = o[mt][h + 2];
    }
    if (warp == 0 && g == 0) {
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < THREADS / 32; ++w) l += red[w * MMA_ROWS + 2 * q + h];
      p.m[slot * p.RP + r] = rows.m[h];
      p.l[slot * p.RP + r] = l;
    }
  }
}

template <typename T, int D>
void launch_mma_d(const Params& p, dim3 grid, size_t stage, cudaStream_t stream) {
  // buffered walks stage in bulk (where they were measured)
  auto kern = !p.bulk ? bitmap_sparse_attention_mma_kernel<T, D, false, false>
              : p.walk == WALK_MMA_BUFFERED ? bitmap_sparse_attention_mma_kernel<T, D, true, true> : bitmap_sparse_attention_mma_kernel<T, D, true, false>;
  const size_t smem = mma_head_bytes(p.bulk) + stage + 16;  // a nibble's first word may lie past the last run
  if (smem > 48 * 1024) check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kern<<<grid, THREADS, smem, stream>>>(p);
  check(cudaGetLastError());
}

template <typename T>
void launch_mma(const Params& p, dim3 grid, size_t stage, cudaStream_t stream) {
  if (p.D == 64) launch_mma_d<T, 64>(p, grid, stage, stream);
  else launch_mma_d<T, 128>(p, grid, stage, stream);
}

}  // namespace bsa
