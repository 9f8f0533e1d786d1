"""The `preprocess` step, free of Triton: a request's prompt and media into the contract's
`PreprocessOutput` (`preprocessor.Preprocessor`), its options over the checkpoint's (`request`),
its media items planned and decoded in parallel (`items`), by the family's processor rules.
"""
