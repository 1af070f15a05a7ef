"""`kvrelay bench serve` (command.py) and `kvrelay bench compare` (compare.py): a seeded load generator for
any OpenAI- or Anthropic-compatible server on loopback (workload.py, clients.py, load.py), its numbers
(summary.py) and its table and plots (report.py); then several servers' results side by side."""
