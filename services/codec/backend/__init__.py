"""The stack behind the codec: the Backend protocol (token IDs in, token IDs out), its gRPC client towards
the router, and readiness.
"""
