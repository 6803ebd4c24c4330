// Host entry of the CUDA backend (kernels: bitmap_sparse_attention.cuh, one .cu per dtype).
#include <torch/extension.h>
#include "bitmap_sparse_attention.cuh"

// built in the per-dtype translation units
extern template void dispatch<half>(const Params&, int, int, dim3, size_t, cudaStream_t);
extern template void dispatch<__nv_bfloat16>(const Params&, int, int, dim3, size_t, cudaStream_t);
extern template void bsa::launch_mma<half>(const Params&, dim3, size_t, cudaStream_t);
extern template void bsa::launch_mma<__nv_bfloat16>(const Params&, dim3, size_t, cudaStream_t);

// q [BH, R, D]; kbm int64 [BH, Tc, DT]; vbm int64 [BH, NB, D]; offsets int64 [BH * NB + 1]; window
// [BH, W, D] (Tc, NB, W: the capacity where lens is given); lens int32 [2] (valid compressed and
// window tokens, read on the device) or an empty tensor; acc float [BH, S+1, RP, DP]; m, l float
// [BH, S+1, RP]. nr in {1, 2, 4, 8}: rows per program; bulk: the tensor-core walk stages with bulk
// copies (sm_90); stream: the cudaStream_t to launch on (torch's current stream, from Python).
void bitmap_sparse_attention(torch::Tensor q, torch::Tensor kbm, torch::Tensor knz, torch::Tensor koff,
                             torch::Tensor vbm, torch::Tensor vnz, torch::Tensor voff, torch::Tensor wk, torch::Tensor wv,
                             torch::Tensor lens, torch::Tensor acc, torch::Tensor m, torch::Tensor l, double scale_log2,
                             int64_t Tc, int64_t W, int64_t NB, int64_t BPS, int64_t S, int64_t kcap, int64_t vcap,
                             int64_t nr, int64_t half_tables, int64_t walk, int64_t bits_global, int64_t bulk, int64_t stream) {
  Params p;
  TORCH_CHECK(lens.numel() == 0 || (lens.numel() == 2 && lens.scalar_type() == at::kInt && lens.is_cuda()), "lens: int32 [2] on the device, or empty");
  p.lens = lens.numel() ? lens.data_ptr<int>() : nullptr;
  p.q = q.data_ptr(); p.kbm = reinterpret_cast<const uint64_t*>(kbm.data_ptr()); p.knz = knz.data_ptr();
  p.koff = koff.data_ptr<int64_t>(); p.vbm = reinterpret_cast<const uint64_t*>(vbm.data_ptr()); p.vnz = vnz.data_ptr();
  p.voff = voff.data_ptr<int64_t>(); p.wk = wk.data_ptr(); p.wv = wv.data_ptr();
  p.acc = acc.data_ptr<float>(); p.m = m.data_ptr<float>(); p.l = l.data_ptr<float>();
  p.scale_log2 = (float)scale_log2;
  p.Tc = (int)Tc; p.W = (int)W; p.D = (int)q.size(2); p.DT = (p.D + 63) / 64; p.NB = (int)NB; p.R = (int)q.size(1);
  p.RP = (int)acc.size(2); p.DP = (int)acc.size(3); p.BPS = (int)BPS; p.S = (int)S;
  p.KCAP = (int)kcap; p.VCAP = (int)vcap; p.half_tables = (int)half_tables; p.walk = (int)walk;
  p.bits_global = (int)bits_global; p.bulk = (int)bulk;
  p.TCS = p.Tc; p.NBS = p.NB; p.WS = p.W;
  // bulk copies move whole 16-byte units between 16-byte aligned addresses, or never complete (a hang,
  // not an error): refuse a launch that would break that (bitmap_sparse_attention.py stages such
  // caches with cp.async: use_bulk_copies)
  TORCH_CHECK(!bulk || ((int64_t)p.TCS * p.DT % 2 == 0 && (reinterpret_cast<uintptr_t>(kbm.data_ptr()) | reinterpret_cast<uintptr_t>(vbm.data_ptr()) |
                         reinterpret_cast<uintptr_t>(knz.data_ptr()) | reinterpret_cast<uintptr_t>(vnz.data_ptr())) % 16 == 0),
              "bulk copies need 16-byte aligned sources and key bits of a multiple of 16 bytes per KV head (head_dim 64: an even token count)");
  const int cpt = p.D <= THREADS ? 1 : 2;
  const int bh = (int)q.size(0);
  const bool f16 = q.scalar_type() == at::kHalf;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "float16 or bfloat16 only");
  // the shared-memory stage: bitmaps (unless read from global memory), then the packed elements
  const size_t esz = q.element_size();
  const size_t bits = bits_global ? 0 : (size_t)PAIR * p.DT * 8 + (size_t)2 * p.D * 8;
  const size_t stage = bits + (p.KCAP * esz + 15) / 16 * 16 + STAGE_GUARD + (p.VCAP * esz + 15) / 16 * 16;
  if (walk == WALK_MMA || walk == WALK_MMA_BUFFERED) {
    TORCH_CHECK((p.D == 64 || p.D == 128) && !bits_global, "the tensor-core walk serves head_dim 64 and 128 with staged bits");
    dim3 grid(bh, p.S + 1, (p.R + MMA_ROWS - 1) / MMA_ROWS);
    if (f16) launch_mma<half>(p, grid, stage, s); else launch_mma<__nv_bfloat16>(p, grid, stage, s);
    return;
  }
  dim3 grid(bh, p.S + 1, (p.R + nr - 1) / nr);
  // the kernel's layout: scores, row state, scan scratch, then the query / probability tables
  size_t head = ((size_t)(PAIR * nr + 3 * nr + 8) * 4 + (size_t)(p.D * nr + PAIR * nr) * (half_tables ? 2 : 4) + 15) / 16 * 16;
  size_t smem = head + stage;
  if (f16) dispatch<half>(p, (int)nr, cpt, grid, smem, s); else dispatch<__nv_bfloat16>(p, (int)nr, cpt, grid, smem, s);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bitmap_sparse_attention", &bitmap_sparse_attention, "bitmap decode attention, layout v2 (partials)");
}
