"""The `kvrelay` command: one entry point, one module per subcommand group."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from services.common.errors import (
    CONFIG_EXIT_CODE,
    CapacityError,
    ConfigError,
    KvrelayError,
    ModelLoadError,
)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    from services.cli import (
        bench,
        canary,
        codec,
        config,
        generate,
        keys,
        models,
        router,
        status,
        up,
        worker,
    )

    parser = argparse.ArgumentParser(prog="kvrelay", description="kvrelay: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    config.register(sub)
    models.register(sub)
    generate.register(sub)
    bench.register(sub)
    worker.register(sub)
    router.register(sub)
    codec.register(sub)
    up.register(sub)
    status.register(sub)
    canary.register(sub)
    keys.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"kvrelay: config error: {exc}", file=sys.stderr)
        return CONFIG_EXIT_CODE
    except (CapacityError, ModelLoadError) as exc:
        # Deterministic: a restart cannot fix them, so supervisors must not retry.
        print(f"kvrelay: {type(exc).__name__}: {exc}", file=sys.stderr)
        return CONFIG_EXIT_CODE
    except KvrelayError as exc:
        print(f"kvrelay: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
