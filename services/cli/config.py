"""`kvrelay config validate`: load a config the way every service does and print the result."""

from __future__ import annotations

import argparse

from services.common.config import dump_config, load_config


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("config", help="check configuration files")
    actions = parser.add_subparsers(dest="config_command", required=True)
    validate = actions.add_parser(
        "validate",
        help="validate a config file plus KVRELAY_<SECTION>__<KEY> overrides and print the effective config",
    )
    validate.add_argument("--config", metavar="FILE", default=None, help="YAML config file (default: none)")
    validate.set_defaults(handler=validate_config)


def validate_config(args: argparse.Namespace) -> int:
    """Print "config OK" and the effective config. A ConfigError propagates: main exits with 78."""
    cfg = load_config(args.config)
    print("config OK")
    print(dump_config(cfg), end="")
    return 0
