"""The models as Triton serves them: the ensemble's orchestration (`pipeline`, free of Triton) and
its stream to the llm over the server's own gRPC endpoint (`loopback`), and the Python-backend
adapters, one per model (`backend`).
"""
