// Host side of kvtool/kernels/kivi_decode.cuh and kivi_decode_swapped.cuh: checks nothing
// (kivi_attention.py checks the tensors), picks the kernel and the instance for (head_dim, bits) and
// launches on the given stream.
#include <torch/extension.h>
#include <cuda_runtime.h>
#include "kivi_decode.cuh"

namespace kivi {

#ifndef KIVI_STAGES
#define KIVI_STAGES 3
#endif
#ifndef KIVI_MINB
#define KIVI_MINB 3
#endif
constexpr int WARPS = 4;  // kivi_decode_swapped.cu launches as many
constexpr int STAGES = KIVI_STAGES;  // blocks in flight per warp (cp.async ring)
constexpr int MINB = KIVI_MINB;      // __launch_bounds__ blocks per SM (caps the registers; shared memory allows 3)
// kivi_decode_swapped.cu (a translation unit of its own, so that nvcc builds both at once): the
// swapped kernel's instance for (head_dim d, bits, p.gv), launched with ctas x bh blocks of WARPS warps
// (the host's Params and stream; nothing of torch crosses)
void launch_swapped(const Params& p, int ctas, long long bh, int nkg, int d, int bits, cudaStream_t stream);

template <int D, int BITS, int GV>
void launch_gv(const Params& p, int ctas, long long bh, int nkg, cudaStream_t stream) {
  constexpr int SUB = 1;
  auto kernel = kivi_decode_kernel<D, BITS, SUB, GV, STAGES, WARPS, MINB>;
  const int smem = block_smem<D, BITS, SUB, GV>(nkg, STAGES, WARPS);
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<dim3(ctas, (unsigned)bh), WARPS * 32, smem, stream>>>(p);
}

template <int D, int BITS>
void launch(const Params& p, int ctas, long long bh, int nkg, cudaStream_t stream) {
  switch (p.gv) {
    case 1: launch_gv<D, BITS, 1>(p, ctas, bh, nkg, stream); break;
    case 2: launch_gv<D, BITS, 2>(p, ctas, bh, nkg, stream); break;
    case 4: launch_gv<D, BITS, 4>(p, ctas, bh, nkg, stream); break;
    default: launch_gv<D, BITS, 8>(p, ctas, bh, nkg, stream); break;
  }
}

int block_tokens(int bits) { return 1 * 8 * (16 / bits); }

void kivi_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor ks, torch::Tensor kz, torch::Tensor vc, torch::Tensor vs,
                 torch::Tensor vz, torch::Tensor lengths, torch::Tensor acc, torch::Tensor m, torch::Tensor l, int64_t hkv,
                 int64_t bits, int64_t group, int64_t splits, double scale_log2, int64_t stream, int64_t kernel) {
  Params p;
  p.q = reinterpret_cast<const half*>(q.data_ptr());
  p.kc = kc.data_ptr<uint8_t>();
  p.ks = reinterpret_cast<const half*>(ks.data_ptr());
  p.kz = reinterpret_cast<const half*>(kz.data_ptr());
  p.vc = vc.data_ptr<uint8_t>();
  p.vs = reinterpret_cast<const half*>(vs.data_ptr());
  p.vz = reinterpret_cast<const half*>(vz.data_ptr());
  p.lengths = lengths.data_ptr<int>();
  p.acc = acc.data_ptr<float>();
  p.m = m.data_ptr<float>();
  p.l = l.data_ptr<float>();
  p.sq_b = q.stride(0);
  p.sq_h = q.stride(1);
  p.sq_t = q.stride(2);
  p.kc_bh = kc.stride(1);
  p.kc_c = kc.stride(2);
  p.ks_bh = ks.stride(1);
  p.ks_g = ks.stride(3);
  p.vc_bh = vc.stride(1);
  p.vc_t = vc.stride(2);
  p.vs_bh = vs.stride(1);
  p.vs_t = vs.stride(2);
  const int d = (int)q.size(3);
  p.hkv = (int)hkv;
  p.g = (int)(q.size(1) / hkv);
  p.tq = (int)q.size(2);
  p.rows = p.g * p.tq;
  p.splits = (int)splits;
  p.dp = (int)acc.size(3);
  p.gv = (int)vs.size(3);
  int lg = 0;
  while ((1 << lg) < group) ++lg;
  p.log2_group = lg;
  const long long vs_head = p.vs_bh * 2, vs_base = (long long)reinterpret_cast<uintptr_t>(p.vs) | reinterpret_cast<uintptr_t>(p.vz);
  p.vs_align = (vs_head % 16 == 0 && vs_base % 16 == 0) ? 16 : (vs_head % 4 == 0 && vs_base % 4 == 0) ? 4 : 2;
  p.k16 = (p.kc_c % 16 == 0 && p.kc_bh % 16 == 0 && reinterpret_cast<uintptr_t>(p.kc) % 16 == 0) ? 1 : 0;
  p.scale_log2 = (float)scale_log2;
  const long long bh = q.size(0) * hkv;
  const int bt = block_tokens((int)bits);
  const int nkg = bt > group ? bt / (int)group : 1;
  const int ctas = (int)(splits / WARPS);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  // kernel 0: the swapped kernel where it serves (at most 8 query rows), else the 16-row one; 1: the 16-row one
  if (kernel == 0 && p.rows <= 8) {
    launch_swapped(p, ctas, bh, nkg, d, (int)bits, s);
  } else if (d == 128) {
    if (bits == 4) launch<128, 4>(p, ctas, bh, nkg, s);
    else if (bits == 2) launch<128, 2>(p, ctas, bh, nkg, s);
    else launch<128, 8>(p, ctas, bh, nkg, s);
  } else {
    if (bits == 4) launch<64, 4>(p, ctas, bh, nkg, s);
    else if (bits == 2) launch<64, 2>(p, ctas, bh, nkg, s);
    else launch<64, 8>(p, ctas, bh, nkg, s);
  }
}

}  // namespace kivi

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kivi_decode", &kivi::kivi_decode, "KIVI decode attention, codes dequantised in the MMA fragments (split partials); kernel 0: swapped where rows <= 8, 1: 16-row");
}
