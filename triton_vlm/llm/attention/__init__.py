"""Attention over the paged KV cache: each step's metadata, built once, and the backend every
attention layer calls (`base`: the torch one), the cache's tensors (`cache`: K/V blocks and the
recurrent states), and on CUDA the Triton-language kernels (`kernels`) behind paged decode (`cuda`)
and paged prefill (`paged_prefill`).
"""
