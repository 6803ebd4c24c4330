"""Every transformers touchpoint: model loading, capture, the attention hook, caches, generation."""
