"""Timing the decode kernels against cuBLAS and FlashInfer: the harness, the suites, plots, reports."""
