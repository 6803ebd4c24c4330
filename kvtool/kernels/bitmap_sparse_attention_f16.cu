// half kernels: see bitmap_sparse_attention.cuh
#include "bitmap_sparse_attention.cuh"
BSA_INSTANTIATE(half)
