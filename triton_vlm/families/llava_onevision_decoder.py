"""LLaVA-OneVision's decoder: LLaVA's Qwen2 (1-D RoPE), its rows replacing both the image and the
video placeholder (`image_token_index`, `video_token_index`). Kept out of `llm/model.py` while that
module is being restructured; it belongs beside `LLAVA_QWEN2` there. Imported only when the llm
loads (`Family.decoder`), so the families package stays free of torch."""
from __future__ import annotations

from triton_vlm.llm.model import HalfPairs, DecoderSpec, Qwen2Layer

LLAVA_ONEVISION_QWEN2 = DecoderSpec(Qwen2Layer, HalfPairs, ("image_token_index", "video_token_index"), mrope=False)
