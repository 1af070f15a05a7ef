"""`kvrelay bench peers`' own decisions, without any server: llama.cpp's CMake flags from the CPU's
flags (never a native build, so never AMX), and the --peers list it accepts."""

from __future__ import annotations

import argparse

import pytest

from services.bench.peers import PEERS, llama_cmake_args, parse_peers


def test_llama_flags_add_only_the_avx512_extensions_the_cpu_lists_and_never_native() -> None:
    assert llama_cmake_args(set()) == "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
    flags = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    args = llama_cmake_args(flags).split()
    assert args == ["-DGGML_NATIVE=OFF", "-DLLAVA_BUILD=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_BF16=ON"]
    assert not [a for a in args if "AMX" in a]


def test_peers_keeps_the_order_given_with_ours_first() -> None:
    assert parse_peers(argparse.Namespace(peers=" kvrelay,llama-cpp ")) == ["kvrelay", "llama-cpp"]
    assert parse_peers(argparse.Namespace(peers=",".join(PEERS))) == list(PEERS)


@pytest.mark.parametrize("peers", ["", "kvrelay,vllm", "kvrelay,kvrelay"])
def test_peers_refuses_unknown_empty_or_repeated_names(peers: str) -> None:
    with pytest.raises(SystemExit, match="--peers takes distinct names"):
        parse_peers(argparse.Namespace(peers=peers))
