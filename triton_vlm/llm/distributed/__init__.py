"""Tensor parallelism's leaves: the collectives the layers and the model call (`collectives`) and
the split of the weights between ranks (`sharding`). The processes that run the ranks are the
engine's (`triton_vlm.llm.engine.tensor_parallel`).
"""
