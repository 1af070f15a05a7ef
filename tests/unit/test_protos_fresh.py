"""The committed gRPC code matches protos/: regenerate into a temp dir and compare."""

from __future__ import annotations

import filecmp
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    subprocess.run(["bash", "scripts/gen_protos.sh", str(tmp_path)], cwd=REPO, check=True)
    committed = REPO / "services" / "proto_gen" / "kvrelay" / "v1"
    fresh = tmp_path / "kvrelay" / "v1"
    names = sorted(p.name for p in fresh.glob("*.py*"))
    assert names, "protoc produced nothing"
    _, mismatch, errors = filecmp.cmpfiles(committed, fresh, names, shallow=False)
    assert not mismatch and not errors, f"run `make protos`: stale {mismatch + errors}"
