"""The Triton Python-backend side of the models: one adapter per model (`preprocess`,
`vision_encoder`, `vision_encoder_batch`, `ensemble`, `llm`), each named by its
`model_repository/<model>/1/model.py`. An adapter reads its request as the contract's message,
makes one call into the package and writes the result back; `InvalidInput` becomes Triton's
INVALID_ARG with the message as is, so a bad request fails alone. `pb` is the only module that
imports `triton_python_backend_utils`.
"""
