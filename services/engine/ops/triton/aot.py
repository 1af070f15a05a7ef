"""Ahead-of-time compiles of every kernel specialization for a GPU target, with no GPU present.

`compile_spec(spec, arch)` builds each kernel's signature (pointer dtypes, int and float arguments, the
constexprs the launcher passes) and compiles it with `triton.compile` for `cuda:<arch>`: what the GPU
machine's JIT will compile, so a kernel that fails to build or overflows shared memory fails here, on
the CPU, in CI. The launcher (launch.py) and these signatures must agree: the test walks the table.

Runs only where the kernels were defined without TRITON_INTERPRET (interpreted kernels do not compile).
`python -m services.engine.ops.triton.aot` compiles the whole table and prints one JSON line: a row
(dtype, head_dim, block_size, kernel, shared bytes) per compile, and the Triton version. With another
Triton on PYTHONPATH first (`pip install --target DIR triton==3.6.0`), it checks that version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.engine.ops.triton import kernels
from services.engine.ops.triton.dispatch import NUM_SEGMENTS, KernelSpec

H200_ARCH = 90
H200_SHARED_BYTES = 232_448  # 227 KiB of shared memory per block, opt-in maximum on sm_90


@dataclass(frozen=True)
class Compiled:
    kernel: str
    shared_bytes: int
    num_warps: int


def _signature(fn: Any, types: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name.startswith("stride_") or name in ("window", "num_rows", "group_size", "group_pad"):
            sig[name] = "i32"
        else:
            raise KeyError(f"no type for argument {name!r} of {fn.__name__}")
    return sig


def kernel_sources(spec: KernelSpec) -> list[tuple[Any, dict[str, str], dict[str, Any], int]]:
    """(kernel, signature, constexprs, num_warps) for each kernel this specialization launches."""
    t = spec.triton_dtype
    attention: dict[str, Any] = {"PRECISION": spec.precision, "UPCAST": False, "HEAD_DIM": spec.head_dim}
    attention |= {"BLOCK_SIZE": spec.block_size, "BLOCK_M": spec.block_m}
    cache = {"q_ptr": f"*{t}", "cache_ptr": f"*{t}", "tables_ptr": "*i64", "query_start_ptr": "*i32"}
    cache |= {"seq_lens_ptr": "*i32", "qk_scale": "fp32"}
    parts = {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
    store_types = {"k_ptr": f"*{t}", "v_ptr": f"*{t}", "cache_ptr": f"*{t}", "slot_ptr": "*i64"}
    split = attention | {"NUM_SEGMENTS": NUM_SEGMENTS}
    sources: list[tuple[Any, dict[str, str], dict[str, Any], int]] = [
        (kernels.store_kv_kernel, store_types, {"HEAD_DIM": spec.head_dim}, 4),
        (kernels.paged_attention_kernel, {"out_ptr": f"*{t}", **cache}, attention, spec.num_warps),
        (kernels.split_decode_kernel, {**parts, **cache}, split, spec.num_warps),
        (
            kernels.reduce_segments_kernel,
            {"out_ptr": f"*{t}", **parts, "query_start_ptr": "*i32", "seq_lens_ptr": "*i32"},
            {"HEAD_DIM": spec.head_dim, "NUM_SEGMENTS": NUM_SEGMENTS},
            4,
        ),
    ]
    return [(fn, _signature(fn, types, consts), consts, warps) for fn, types, consts, warps in sources]


def compile_spec(spec: KernelSpec, arch: int = H200_ARCH) -> list[Compiled]:
    """Compile every kernel of `spec` for cuda:`arch` (warp size 32); raises on a compile error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernels.INTERPRETED:
        raise RuntimeError("the kernels were defined under TRITON_INTERPRET=1 and cannot be compiled")
    target = GPUTarget("cuda", arch, 32)
    out = []
    for fn, signature, constexprs, warps in kernel_sources(spec):
        options = {"num_warps": warps, "num_stages": spec.num_stages}
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)
        out.append(Compiled(fn.__name__, int(compiled.metadata.shared), warps))
    return out


def main() -> None:
    import triton

    from services.engine.ops.triton.dispatch import specializations

    rows = [
        [s.triton_dtype, s.head_dim, s.block_size, c.kernel, c.shared_bytes]
        for s in specializations()
        for c in compile_spec(s)
    ]
    print(json.dumps({"triton": triton.__version__, "arch": H200_ARCH, "compiled": rows}))


if __name__ == "__main__":
    main()
