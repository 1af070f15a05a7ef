"""The benchmark harness behind `kvrelay bench` (installed with the `bench` extra, never in an image).

One module or sub-package per benchmark: `engine` (our engine core against transformers' generate),
`agreement` (our greedy text against llama.cpp's on the same GGUF), `stack` (concurrent streams through
a running stack), `serve` (a load generator for any OpenAI- or Anthropic-compatible server on loopback,
and `compare` across servers), `routing` (replica policies side by side), `transfer` (the cost of moving
the KV cache), `admission` (one tenant flooding past its quota while another is measured) and `peers`
(bench serve against peer servers). Shared pieces: `stats` (every statistic), `tables` (the text
tables), `plots` (every chart; matplotlib is imported only when one is drawn) and `spawn` (stacks started
under `kvrelay up`'s own supervisor).

`services/cli/bench.py` imports this package only when `kvrelay bench` runs; `cli.main` parses its flags.
"""
