"""`kvrelay keys add | list | revoke`: the key is printed once and stored only as its digest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.main import main
from services.codec.admission.auth import KeyStore, key_digest, read_keys_file
from services.common.errors import CONFIG_EXIT_CODE


def add(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["keys", "add", *args]) == 0
    out, err = capsys.readouterr()
    assert "shown only this once" in err
    key = out.strip()
    assert "\n" not in key  # stdout holds the key alone
    return key


def test_add_prints_a_working_key_and_stores_only_its_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    key = add(capsys, "--file", str(path), "--tenant", "acme")
    other = add(capsys, "--file", str(path), "--tenant", "beta")
    text = path.read_text()
    assert key not in text and other not in text
    assert key_digest(key) in text
    assert path.stat().st_mode & 0o777 == 0o600
    records = read_keys_file(path)
    assert [r.tenant for r in records] == ["acme", "beta"]
    assert all(r.created.endswith("Z") for r in records)
    tenant = KeyStore(path).tenant_for(key)
    assert tenant is not None and tenant.tenant_id == "acme" and tenant.key_id == records[0].key_id


def test_list_shows_ids_and_tenants_but_no_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    key = add(capsys, "--file", str(path), "--tenant", "acme")
    assert json.loads(path.read_text())["keys"][0]["tenant"] == "acme"  # .json files stay JSON
    assert main(["keys", "list", "--file", str(path)]) == 0
    table = capsys.readouterr().out
    key_id = read_keys_file(path)[0].key_id
    assert key_id in table and "acme" in table and key not in table and key_digest(key) not in table
    assert main(["keys", "list", "--file", str(path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["keys"]
    assert [(k["key_id"], k["tenant"]) for k in listed] == [(key_id, "acme")]
    assert "sha256" not in listed[0]


def test_a_key_may_be_allowed_a_24h_cache_retention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    plain = add(capsys, "--file", str(path), "--tenant", "acme")
    allowed = add(capsys, "--file", str(path), "--tenant", "acme", "--cache-retention-24h")
    store = KeyStore(path)
    assert [store.tenant_for(k).may_retain_24h for k in (plain, allowed)] == [False, True]  # type: ignore[union-attr]
    assert main(["keys", "list", "--file", str(path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["keys"]
    assert [k["cache_retention_24h"] for k in listed] == [False, True]
    assert main(["keys", "list", "--file", str(path)]) == 0
    header, first, second = capsys.readouterr().out.splitlines()
    assert header.endswith("RETAIN 24H  PRIORITY") and "yes" not in first and second.rstrip().endswith("yes")


def test_a_key_may_be_allowed_the_high_priority_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    plain = add(capsys, "--file", str(path), "--tenant", "acme")
    allowed = add(capsys, "--file", str(path), "--tenant", "acme", "--priority-tier")
    store = KeyStore(path)
    assert [store.tenant_for(k).may_use_priority for k in (plain, allowed)] == [False, True]  # type: ignore[union-attr]
    assert main(["keys", "list", "--file", str(path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["keys"]
    assert [(k["priority_tier"], k["cache_retention_24h"]) for k in listed] == [(False, False), (True, False)]
    assert main(["keys", "list", "--file", str(path)]) == 0
    header, first, second = capsys.readouterr().out.splitlines()
    assert "yes" not in first and second.endswith("yes") and second.index("yes") == header.index("PRIORITY")


def test_revoke_removes_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.yaml"
    key = add(capsys, "--file", str(path), "--tenant", "acme")
    kept = add(capsys, "--file", str(path), "--tenant", "acme")
    key_id = read_keys_file(path)[0].key_id
    assert main(["keys", "revoke", "--file", str(path), "--key-id", key_id]) == 0
    store = KeyStore(path)
    assert store.tenant_for(key) is None and store.tenant_for(kept) is not None
    assert main(["keys", "revoke", "--file", str(path), "--key-id", key_id]) == 2
    assert f"no key with ID {key_id}" in capsys.readouterr().err


def test_the_file_comes_from_the_config_when_not_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "from-env.yaml"
    monkeypatch.setenv("KVRELAY_AUTH__KEYS_FILE", str(path))
    add(capsys, "--tenant", "acme")
    assert [r.tenant for r in read_keys_file(path)] == ["acme"]
    monkeypatch.delenv("KVRELAY_AUTH__KEYS_FILE")
    assert main(["keys", "list"]) == CONFIG_EXIT_CODE
    assert "no keys file" in capsys.readouterr().err


@pytest.mark.parametrize("tenant", ["", "a b", "-lead", "x" * 65, "ünï"])
def test_a_bad_tenant_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tenant: str
) -> None:
    path = tmp_path / "keys.yaml"
    assert main(["keys", "add", "--file", str(path), f"--tenant={tenant}"]) == CONFIG_EXIT_CODE
    assert not path.exists()


def test_listing_a_missing_file_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "list", "--file", str(tmp_path / "absent.yaml")]) == CONFIG_EXIT_CODE
    assert "cannot be read" in capsys.readouterr().err
