"""The public gRPC API (kvrelay.v1.Generation): the servicer, its request conversion, and its server."""
