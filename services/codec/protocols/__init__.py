"""The wire protocols: one module per protocol (OpenAI Chat, Completions, Responses; Anthropic Messages),
their schemas, and what they share. Import no transport (no gRPC, no Redis).
"""
