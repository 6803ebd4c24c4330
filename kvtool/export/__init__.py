"""Handing kvtool files on: transformers caches, FlashInfer/vLLM pages, numpy, dense captures, tables."""
