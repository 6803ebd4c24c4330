"""The dense decode-attention baselines alone."""

from __future__ import annotations


from kvtool.bench import harness as B
from kvtool.bench.suites.common import (
    DENSE_BASELINES,
    BenchContext,
    dense_records,
    free_memory,
    register_suite,
)

@register_suite('dense', ('torch_dense', 'flashinfer_batch'),
                'The dense decode-attention baselines alone: cuBLAS q·Kᵀ and P·V, torch dense (matmul + softmax), torch SDPA, FlashInfer single and batched paged decode.',
                'kvtool bench dense --model-shape llama3-8b --batch 1,8,32 --seq 4k,32k -o dense.json')
def suite_dense(ctx: BenchContext) -> list[dict]:
    """The dense decode-attention baselines alone, over the batch x seq sweep."""
    recs = []
    for b, t in ctx.configs():
        shape, q, k, v, data = ctx.inputs(b, t)
        recs += dense_records(ctx, shape, q, k, v, data)
        del q, k, v
        free_memory(ctx)
    B.add_speedups(recs, list(DENSE_BASELINES))
    return recs
