"""triton-vlm: vision-language models on Triton Inference Server.

The package in layers, from the top:

- `tools` (the `triton-vlm` console script, the demo, load tests), `repository` (`triton-vlm
  build`), `clients` (of a running server's ensemble) and `server` (tritonserver itself);
- `serving`: the models as Triton runs them (one Python-backend adapter per model, the ensemble's
  pipeline and its stream to the llm);
- the steps, free of Triton: `preprocessing`, `vision` (the encoder front, batching, runtimes),
  `llm` (the decoder and its engine). They look a checkpoint's family up in `families`;
- `families`: one folder per family (processor rules, tower, decoder spec, demo checkpoint) and
  the registry, made of the building blocks below;
- the building blocks: `media` (decoding, sizing, pixel rows, positions), `vision.tower`,
  `llm.layers`, `llm.attention`, `llm.distributed`;
- the ground: `contract` (every tensor, message and parameter that crosses a process), `errors`,
  `devices`, `weights`.
"""
