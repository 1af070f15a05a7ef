"""Fast kernels for the engine: C code built at first use, each with a torch reference beside it.

`build.load_cpu_kernels()` returns the CPU kernels, or None where the CPU lacks AVX2/FMA; callers then
take their plain torch path. A build that fails (no C compiler, a compile error) raises KernelBuildError
instead of falling back. `reference` holds the slow paths the tests compare against.
"""
