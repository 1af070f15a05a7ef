"""The codec and common packages import without torch (STYLE principle 1)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO_ROOT

_IMPORT_ALL = textwrap.dedent(
    """
    import importlib
    import pkgutil
    import sys

    import services.codec
    import services.common

    names = []
    for package in (services.codec, services.common):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
            names.append(info.name)
    print("\\n".join(names))
    loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
    if loaded:
        sys.exit("torch was imported: " + ", ".join(loaded[:5]))
    """
)


def test_codec_and_common_modules_import_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    imported = result.stdout.split()
    assert "services.codec.text.tokenizer" in imported
    assert "services.codec.text.detokenizer" in imported
