"""`kvrelay bench transfer` (command.py): what moving the KV cache between processes costs on loopback.
stack.py starts the workers and routers, client.py times the requests, report.py prints the tables."""
