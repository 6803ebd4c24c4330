"""Triton kernels, each beside a plain-torch reference of the same maths (see each module)."""
