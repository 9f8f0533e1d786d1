"""What runs the decoder: the engine (`engine`: in-flight batching, one scheduler thread), its
step planner (`scheduler`) and KV block manager (`block_manager`), a request inside it
(`sequence`, its inputs checked by `inputs`), the model runner (`runner`, with CUDA graphs of
decode steps: `cuda_graphs`), the other ranks of a tensor-parallel model (`tensor_parallel`), the
sampler (`sampling`) and guided decoding's grammars (`grammar`), and what comes out (`streaming`,
`output`, and the `llm` model's tensors: `responses`).
"""
