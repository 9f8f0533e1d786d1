"""The vision encoder: what every family's tower is made of (`tower`), the runtimes a tower runs on
(`runtime`: ONNX Runtime, torch, TensorRT, and the ONNX export), and the logic of the two Triton
models that serve it: the `vision_encoder` front (`front`) and the batched `vision_encoder_batch`
with its embedding cache (`batching`).

Every tower encodes each temporal grid step on its own (attention, rotary positions and position
embeddings never cross frames) unless it packs frames (`Tower.PACKED_FRAMES`), so the front sends
a video's frames as items of their own and the encoder runs steps of one spatial size together;
neither changes the result.
"""
