// Launches of the swapped KIVI kernel (kivi_decode_swapped.cuh), for kivi_decode.cu's host code: a
// translation unit of its own so that nvcc compiles its instances beside those of the 16-row kernel.
#include <cuda_runtime.h>
#include "kivi_decode_swapped.cuh"

#ifndef KIVI_SW_STAGES
#define KIVI_SW_STAGES 2
#endif
#ifndef KIVI_KEY_FOLD
#define KIVI_KEY_FOLD 1  // 0: the per-element key dequantisation everywhere (comparisons)
#endif
#ifndef KIVI_SW_MINB
#define KIVI_SW_MINB 3
#endif

namespace kivi {

// two stages (5 KB a warp at 4 bits) and 3 blocks per SM (at most 168 registers). An H200 sweep at
// batch 1 and 8 x 32k (2026-11-28): three stages within 2% at 4 bits and 29% slower at 2 bits; 4
// blocks per SM (128 registers) 9% slower at 4 bits, and spills at 2 bits.
constexpr int SW_WARPS = 4;  // kivi_decode.cu's WARPS: one split per warp
constexpr int SW_STAGES = KIVI_SW_STAGES;
constexpr int SW_MINB = KIVI_SW_MINB;

template <int D, int BITS, int GV>
void launch_swapped_gv(const Params& p, int ctas, long long bh, int nkg, cudaStream_t stream) {
  constexpr int SUB = 1;
  // key scales folded into the queries where a key group holds a whole sub-block (BTS = 128 / BITS tokens)
  const bool fold = KIVI_KEY_FOLD && (1 << p.log2_group) >= Shape<D, BITS, SUB>::BTS;
  auto kernel = fold ? kivi_decode_swapped_kernel<D, BITS, SUB, GV, SW_STAGES, SW_WARPS, SW_MINB, true>
                     : kivi_decode_swapped_kernel<D, BITS, SUB, GV, SW_STAGES, SW_WARPS, SW_MINB, false>;
  const int smem = block_smem_swapped<D, BITS, SUB, GV>(nkg, SW_STAGES, SW_WARPS);
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<dim3(ctas, (unsigned)bh), SW_WARPS * 32, smem, stream>>>(p);
}

template <int D, int BITS>
void launch_swapped_bits(const Params& p, int ctas, long long bh, int nkg, cudaStream_t stream) {
  switch (p.gv) {
    case 1: launch_swapped_gv<D, BITS, 1>(p, ctas, bh, nkg, stream); break;
    case 2: launch_swapped_gv<D, BITS, 2>(p, ctas, bh, nkg, stream); break;
    case 4: launch_swapped_gv<D, BITS, 4>(p, ctas, bh, nkg, stream); break;
    default: launch_swapped_gv<D, BITS, 8>(p, ctas, bh, nkg, stream); break;
  }
}

void launch_swapped(const Params& p, int ctas, long long bh, int nkg, int d, int bits, cudaStream_t stream) {
  if (d == 128) {
    if (bits == 4) launch_swapped_bits<128, 4>(p, ctas, bh, nkg, stream);
    else if (bits == 2) launch_swapped_bits<128, 2>(p, ctas, bh, nkg, stream);
    else launch_swapped_bits<128, 8>(p, ctas, bh, nkg, stream);
  } else {
    if (bits == 4) launch_swapped_bits<64, 4>(p, ctas, bh, nkg, stream);
    else if (bits == 2) launch_swapped_bits<64, 2>(p, ctas, bh, nkg, stream);
    else launch_swapped_bits<64, 8>(p, ctas, bh, nkg, stream);
  }
}

}  // namespace kivi
