"""What crosses a process boundary, stated once: every tensor of every step and the per-item
extras (`tensors`), a typed message per step (`messages`), the generation controls
(`sampling.SamplingParams`), the models' typed config parameters (`params`) and the preprocess
step's per-request limits (`limits`). The build, the adapters, the pipeline and the loopback all
read it; it imports nothing of the package but `errors`.
"""
