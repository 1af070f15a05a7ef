"""The config schema, YAML loading, environment overrides and `kvrelay config validate`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.cli import config as config_cli
from services.common.config import (
    KvrelayConfig,
    LimitsConfig,
    dump_config,
    encoder_timeout_problem,
    load_config,
)
from services.common.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = REPO_ROOT / "deploy" / "kvrelay.example.yaml"

SEED_SAMPLE = """\
limits:
  max_input_tokens: 2048
  max_output_tokens: 512
  batch_size_limit: 8
  step_timeout_ms: 800
  request_timeout_ms: 30000
  concurrency_limit: 64
"""


def write(tmp_path: Path, text: str, name: str = "kvrelay.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_validate() -> None:
    cfg = load_config(env={})
    assert cfg == KvrelayConfig()
    assert cfg.engine.block_size == 16
    assert cfg.limits.request_timeout_ms == 2_400_000
    assert cfg.model.dtype == "auto"


def test_example_config_validates() -> None:
    cfg = load_config(EXAMPLE_CONFIG, env={})
    assert cfg.server.port == 8000


def test_seed_sample_timeouts_refused_naming_all_three_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(write(tmp_path, SEED_SAMPLE), env={})
    message = str(excinfo.value)
    assert "limits.step_timeout_ms (800)" in message
    assert "limits.max_output_tokens (512)" in message
    assert "limits.request_timeout_ms (30000)" in message
    assert "409600" in message
    assert "cut off by the request timeout while no step had timed out" in message


def test_an_encoder_decoder_deployment_counts_the_encoder_in_the_timeout_rule() -> None:
    """The seed guide's rule, step timeout x max steps <= request timeout, holds here with 20 ms to spare;
    an encoder-decoder model's first token also waits for its encoder, so the encoder timeout must fit
    too (a worker serving one checks it at start)."""
    limits = LimitsConfig(
        step_timeout_ms=800, max_output_tokens=512, request_timeout_ms=409_620, encoder_timeout_ms=10
    )
    assert encoder_timeout_problem(limits) is None
    tight = limits.model_copy(update={"encoder_timeout_ms": 30})
    problem = encoder_timeout_problem(tight)
    assert problem is not None
    assert "limits.encoder_timeout_ms (30) + limits.step_timeout_ms (800)" in problem
    assert "409630 ms exceeds limits.request_timeout_ms (409620)" in problem
    assert encoder_timeout_problem(LimitsConfig()) is None  # the defaults hold for both kinds of model


def test_env_override_of_nested_key_wins_over_file_and_is_typed(tmp_path: Path) -> None:
    path = write(tmp_path, "limits:\n  max_output_tokens: 100\nengine:\n  enable_prefix_caching: true\n")
    env = {
        "KVRELAY_LIMITS__MAX_OUTPUT_TOKENS": "512",
        "KVRELAY_engine__Enable_Prefix_Caching": "false",
        "KVRELAY_MODEL__PATH": "/models/x",
    }
    cfg = load_config(path, env=env)
    assert cfg.limits.max_output_tokens == 512
    assert cfg.engine.enable_prefix_caching is False
    assert cfg.model.path == "/models/x"


def test_env_override_keeps_strings_for_string_settings() -> None:
    cfg = load_config(env={"KVRELAY_MODEL__SERVED_NAME": "1.0", "KVRELAY_SERVER__HOST": "yes"})
    assert cfg.model.served_name == "1.0"
    assert cfg.server.host == "yes"


def test_env_override_null_clears_optional_setting(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  num_threads: 4\n")
    assert load_config(path, env={"KVRELAY_ENGINE__NUM_THREADS": "null"}).engine.num_threads is None


def test_kvrelay_variables_without_double_underscore_are_ignored() -> None:
    env = {"KVRELAY_URL": "http://x", "KVRELAY_TEST_MODEL_DIR": "/tmp/m", "OTHER__THING": "1"}
    assert load_config(env=env) == KvrelayConfig()


def test_unknown_key_in_file_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"limits\.max_tokens_typo: Extra inputs are not permitted"):
        load_config(write(tmp_path, "limits:\n  max_tokens_typo: 3\n"), env={})


def test_unknown_section_in_file_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"service: Extra inputs are not permitted"):
        load_config(write(tmp_path, "service:\n  name: x\n"), env={})


@pytest.mark.parametrize("name", ["KVRELAY_LIMITS__NOPE", "KVRELAY_NOPE__PORT", "KVRELAY_SERVER__PORT__X"])
def test_unknown_env_key_refused_naming_the_variable(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_config(env={name: "1"})


def test_env_variable_with_empty_key_refused() -> None:
    with pytest.raises(ConfigError, match="KVRELAY_LIMITS__"):
        load_config(env={"KVRELAY_LIMITS__": "1"})


def test_bad_field_reported_as_dotted_path_with_its_env_source() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"KVRELAY_LIMITS__BATCH_SIZE_LIMIT": "0"})
    message = str(excinfo.value)
    assert "limits.batch_size_limit: Input should be greater than 0" in message
    assert "KVRELAY_LIMITS__BATCH_SIZE_LIMIT" in message


def test_invalid_yaml_refused_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "limits: [unclosed\n", name="broken.yaml")
    with pytest.raises(ConfigError, match=r"broken\.yaml is not valid YAML"):
        load_config(path, env={})


def test_non_mapping_top_level_refused_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "- a\n- b\n", name="list.yaml")
    with pytest.raises(ConfigError, match=r"list\.yaml must hold a mapping"):
        load_config(path, env={})


def test_missing_file_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.yaml does not exist"):
        load_config(tmp_path / "absent.yaml", env={})


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == KvrelayConfig()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "limits:\n  default_max_output_tokens: 300\n  max_output_tokens: 200\n",
            "limits.default_max_output_tokens (300) exceeds limits.max_output_tokens (200)",
        ),
        (
            "engine:\n  block_size: 64\n  max_num_batched_tokens: 32\n",
            "engine.max_num_batched_tokens (32) is below engine.block_size (64)",
        ),
        (
            "kv_tiers:\n  disk_path: /tmp/kv\n  segment_tokens: 40\n",
            "kv_tiers.segment_tokens (40) is not a multiple of engine.block_size (16)",
        ),
        (
            "engine:\n  max_model_len: 1024\n",
            "limits.max_output_tokens (1024) must be below engine.max_model_len (1024)",
        ),
        ("engine:\n  block_size: 24\n", "engine.block_size: must be a power of two, got 24"),
        ("server:\n  port: 70000\n", "server.port: Input should be less than or equal to 65535"),
        ("model:\n  dtype: float16\n", "model.dtype: Input should be 'auto', 'float32' or 'bfloat16'"),
        ("engine:\n  attention: flash\n", "engine.attention: Input should be 'auto', 'torch' or 'triton'"),
    ],
)
def test_invalid_values_refused_naming_the_settings(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(write(tmp_path, text), env={})
    assert expected in str(excinfo.value)


def test_every_cross_field_problem_reported_at_once(tmp_path: Path) -> None:
    text = "limits:\n  step_timeout_ms: 800\n  request_timeout_ms: 1000\n  max_output_tokens: 100\n"
    with pytest.raises(ConfigError) as excinfo:
        load_config(write(tmp_path, text), env={})
    message = str(excinfo.value)
    assert "limits.request_timeout_ms (1000)" in message
    assert "limits.default_max_output_tokens (256)" in message


def test_dumped_config_loads_back_unchanged(tmp_path: Path) -> None:
    cfg = load_config(env={"KVRELAY_ENGINE__NUM_THREADS": "2", "KVRELAY_MODEL__SERVED_NAME": "smol"})
    assert load_config(write(tmp_path, dump_config(cfg)), env={}) == cfg


def parse_cli(argv: list[str]) -> argparse.Namespace:
    # services.cli.main does not register the config module yet, so build the parser the same way.
    parser = argparse.ArgumentParser(prog="kvrelay")
    config_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_config_validate_prints_ok_and_effective_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRELAY_SERVER__PORT", "9001")
    args = parse_cli(["config", "validate", "--config", str(write(tmp_path, "engine:\n  seed: 7\n"))])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("config OK\n")
    assert "seed: 7" in out
    assert "port: 9001" in out


def test_config_validate_raises_config_error_for_bad_file(tmp_path: Path) -> None:
    args = parse_cli(["config", "validate", "--config", str(write(tmp_path, SEED_SAMPLE))])
    with pytest.raises(ConfigError, match=r"limits\.step_timeout_ms"):
        args.handler(args)
