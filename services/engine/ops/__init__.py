"""Fast kernels for the engine: C code built at first use, each with a torch reference beside it.

`build.load_cpu_kernels()` returns the CPU kernels, or None where they cannot run (no AVX2/FMA, no C
compiler); callers then take their plain torch path. `reference` holds the slow paths the tests compare
against.
"""
