"""gguf-hybrid's step threshold: the shipped table's lookup by CPU class and thread count, the config's
override, and a wrong override refused at start with the setting named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.config import KvrelayConfig
from services.common.errors import ConfigError
from services.engine.ops import step_threshold
from services.engine.ops.step_threshold import cpu_class, load_table, lookup, resolve

AVX2 = frozenset({"avx2", "fma", "f16c"})
ZEN4 = AVX2 | {"avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile"}
ICE_LAKE = AVX2 | {"avx512f", "avx512_vnni"}
TABLE = [
    {"cpu": "avx2", "threads": 1, "small_step_max_tokens": 128, "measured_on": "an AVX2 VM"},
    {"cpu": "avx2", "threads": 2, "small_step_max_tokens": 256, "measured_on": "an AVX2 VM"},
    {"cpu": "avx512_bf16", "threads": 2, "small_step_max_tokens": 12, "measured_on": "a Zen 5 VM"},
]


def test_a_cpu_is_classed_by_its_most_capable_units() -> None:
    assert cpu_class(AVX2) == "avx2"
    assert cpu_class(ZEN4) == "avx512_bf16"
    assert cpu_class(SAPPHIRE_RAPIDS) == "amx"
    assert cpu_class(ICE_LAKE) == "avx512_vnni"
    assert cpu_class(AVX2 | {"avx_vnni"}) == "avx_vnni"


def test_lookup_takes_the_entry_for_the_class_and_the_threads_at_or_below() -> None:
    assert lookup(TABLE, AVX2, 1).max_tokens == 128
    assert lookup(TABLE, AVX2, 2).max_tokens == 256
    assert lookup(TABLE, AVX2, 16).max_tokens == 256  # the most threads measured, up to the engine's
    found = lookup(TABLE, ZEN4, 1)  # fewer threads than any entry: the class's fewest
    assert found.max_tokens == 12 and found.source.startswith("table: avx512_bf16, 2 threads")


def test_a_class_without_entries_borrows_the_nearest_measured_one() -> None:
    found = lookup(TABLE, SAPPHIRE_RAPIDS, 2)
    assert found.max_tokens == 12
    assert "this CPU is amx" in found.source
    assert lookup(TABLE, ICE_LAKE, 2).max_tokens == 256  # 512-bit VNNI, no bf16 units: the AVX2 side


def test_the_shipped_table_covers_avx2_and_bf16_cpus_at_one_and_two_threads() -> None:
    entries = load_table()
    for name in ("avx2", "avx512_bf16"):
        assert {e["threads"] for e in entries if e["cpu"] == name} >= {1, 2}
    assert all(e["measured_on"] and e["command"].startswith(("kvrelay", "scripts/")) for e in entries)


def test_the_setting_overrides_the_table() -> None:
    assert resolve(5, ZEN4, 2) == step_threshold.StepThreshold(5, "engine.small_step_max_tokens")
    assert resolve(None, ZEN4, 2).source.startswith("table: ")


@pytest.mark.parametrize("value", [0, -3])
def test_a_threshold_below_one_is_refused_naming_the_setting(value: int) -> None:
    with pytest.raises(ConfigError, match=r"engine\.small_step_max_tokens"):
        resolve(value, ZEN4, 2)
    with pytest.raises(ValidationError, match="small_step_max_tokens"):
        KvrelayConfig.model_validate({"engine": {"small_step_max_tokens": value}})
