"""triton-vlm: vision-language models on Triton Inference Server."""
