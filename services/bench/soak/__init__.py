"""`kvrelay bench soak`: the local stack under mixed traffic over time, judged on memory, fds, KV, errors."""
