"""`triton-vlm build`: a model repository from a checkpoint. `options` holds the build's choices,
`configs` makes every `config.pbtxt` from the contract, `build` writes the repository.
"""
