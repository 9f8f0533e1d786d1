"""Clients of a running server's `ensemble`: gRPC streaming and HTTP generate (`client`), the
checkpoint's chat template applied as transformers applies it (`chat`), and an OpenAI-compatible
server in front of the ensemble (`openai_server`, with its request-size guard `body_limit`).
"""
