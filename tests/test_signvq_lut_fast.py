"""The word-loading sign-VQ LUT variant against the format's torch scores under TRITON_INTERPRET=1
(GQA groups 1, 3, 4, 8; sum and max; head_dim 64 and 128; partial last block; several programs)."""

from __future__ import annotations

import pytest
import torch

from kvtool.formats.signvq import lut_scores
from kvtool.kernels.signvq_lut import make_signvq_inputs
from kvtool.kernels.signvq_lut_fast import lut_scores_fast


@pytest.mark.parametrize("group,d,tokens,gqa,dtype", [(1, 64, 300, "sum", torch.float16), (3, 128, 257, "max", torch.float32),
                                                      (4, 128, 1000, "sum", torch.float16), (8, 64, 129, "max", torch.bfloat16)])
def test_matches_the_format_scores(group, d, tokens, gqa, dtype, monkeypatch):
    import kvtool.kernels.signvq_lut_fast as fast

    def no_fallback(*args, **kwargs):
        raise AssertionError("fell back to the owner's kernel")

    monkeypatch.setattr(fast, "lut_scores_kernel", no_fallback)
    q, enc = make_signvq_inputs(2, 2 * group, 2, tokens, d, dtype=dtype, device="cpu", budget=32, gqa=gqa)
    codes, book = enc.tensors["index.codes"], enc.tensors["index.codebook"]
    got = lut_scores_fast(q, codes, book, gqa, block_tokens=32, iters=3)
    ref = lut_scores(q, codes, book, gqa)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())


def test_bad_gqa_mode():
    q, enc = make_signvq_inputs(1, 4, 2, 64, 64, dtype=torch.float16, device="cpu", budget=16)
    from kvtool.errors import UsageError

    with pytest.raises(UsageError, match="gqa must be"):
        lut_scores_fast(q, enc.tensors["index.codes"], enc.tensors["index.codebook"], "mean")
