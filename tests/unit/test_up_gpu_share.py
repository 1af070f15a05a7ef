"""`kvrelay up` on one GPU: its workers split the device, and a share that oversubscribes it is refused."""

from __future__ import annotations

import pytest
import torch

from services.cli.up import share_one_gpu
from services.common.config import KvrelayConfig, load_config
from services.common.errors import ConfigError


def config(**engine: object) -> KvrelayConfig:
    return KvrelayConfig.model_validate({"engine": engine})


def test_an_unset_share_is_split_evenly_between_the_workers() -> None:
    assert share_one_gpu(config(), 2).engine.gpu_memory_utilization == 0.45
    assert share_one_gpu(config(), 3).engine.gpu_memory_utilization == 0.3
    assert share_one_gpu(config(), 1).engine.gpu_memory_utilization == 0.9
    assert share_one_gpu(load_config(None, env={}), 4).engine.gpu_memory_utilization == 0.22


def test_a_cpu_stack_keeps_its_config() -> None:
    cpu = config(device="cpu")
    assert share_one_gpu(cpu, 3) is cpu


def test_a_set_share_that_oversubscribes_a_visible_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as refused:
        share_one_gpu(config(gpu_memory_utilization=0.6), 2)
    assert "worker-0 0.60 + worker-1 0.60 = 1.20" in str(refused.value)
    fits = config(gpu_memory_utilization=0.4)
    assert share_one_gpu(fits, 2) is fits


def test_a_set_share_is_not_checked_where_no_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    wide = config(gpu_memory_utilization=0.9)
    assert share_one_gpu(wide, 2) is wide
