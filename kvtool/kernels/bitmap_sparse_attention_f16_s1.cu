// half kernels, 1 shared-memory stage(s): see bitmap_sparse_attention.cuh
#include "bitmap_sparse_attention.cuh"
BSA_INSTANTIATE(half, 1)
