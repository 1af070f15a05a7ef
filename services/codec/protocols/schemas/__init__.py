"""Request schemas, one module per protocol."""
