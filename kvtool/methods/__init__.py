"""Compression methods on dense tensors: pruning masks, token eviction, quantisation, head selection.
Above :mod:`kvtool.core` and :mod:`kvtool.kernels`; knows no file format."""
