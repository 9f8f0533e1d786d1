"""The `triton-vlm` console script (`cli`) and what only it runs: the demo (`demo`) and the load
tests with perf_analyzer and genai-perf (`loadtest`).
"""
