"""The chart's compaction keys (/v1/responses/compact): a Secret mounted read-only into the codec alone and
named to it through KVRELAY_RESPONSES__COMPACTION_KEYS_FILE, a checksum of the Secret on the codec pods so
that `helm upgrade` after a change rolls them (the codec reads the keys once), and a NOTES warning, not a
refusal, when several codec pods would each seal with a random key of their own: the chart's defaults
(autoscaling on) render without the Secret, so a refusal would break every default render.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.codec.protocols.compaction_keys import CompactionKeys
from services.common.config import load_config
from tests.deploy import chart
from tests.deploy.chart import (
    container,
    deployment,
    effective_config_env,
    env_of,
    helm_error,
    pod_spec,
    render,
    render_notes,
    validation_errors,
)

SECRET = "kvrelay-compaction-keys"
WITH_KEYS: dict[str, Any] = {"responses": {"compactionKeys": {"existingSecret": SECRET}}}
ENV = "KVRELAY_RESPONSES__COMPACTION_KEYS_FILE"
WARNING = "WARNING: no responses.compactionKeys.existingSecret"


def test_the_secret_is_mounted_into_the_codec_and_named_by_the_config(tmp_path: Path) -> None:
    objects = render(WITH_KEYS)
    ctr = container(objects, "codec")
    path = env_of(ctr)[ENV]["value"]
    assert path == "/etc/kvrelay/compaction-keys/compaction-keys"

    config = tmp_path / "config.yaml"
    config.write_text(chart.config_yaml(objects))
    cfg = load_config(config, effective_config_env(ctr))
    assert cfg.responses.compaction_keys_file == path
    assert "compaction_keys_file" not in chart.config_yaml(objects)  # through the env only

    mount = next(m for m in ctr["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True and "subPath" not in mount
    volume = next(v for v in pod_spec(objects, "codec")["volumes"] if v["name"] == mount["name"])
    assert volume["secret"] == {"secretName": SECRET, "defaultMode": 0o440}
    assert validation_errors(deployment(objects, "codec")) == []
    assert validation_errors(deployment(objects, "codec"), chart.MIN_KUBE_VERSION) == []

    # Only the codec seals and opens compaction items.
    for stage in ("router", "prefill", "decode"):
        assert ENV not in env_of(container(objects, stage))
        assert SECRET not in yaml.safe_dump(deployment(objects, stage))


def test_the_file_format_the_chart_documents_is_the_one_the_codec_reads(tmp_path: Path) -> None:
    """The Secret's key holds what docs/deploy.md says to put there: two keys, the new one first."""
    lines = [f"{kid}:{base64.b64encode(os.urandom(32)).decode()}" for kid in ("k2", "k1")]
    keys_file = tmp_path / "compaction-keys"
    keys_file.write_text("# new first, old second\n" + "\n".join(lines) + "\n")
    assert CompactionKeys.from_file(str(keys_file)).key_ids == ("k2", "k1")


def test_another_secret_key() -> None:
    objects = render({"responses": {"compactionKeys": {"existingSecret": SECRET, "key": "ring.txt"}}})
    assert env_of(container(objects, "codec"))[ENV]["value"] == "/etc/kvrelay/compaction-keys/ring.txt"


def test_without_the_secret_nothing_is_mounted() -> None:
    objects = render()
    ctr = container(objects, "codec")
    assert ENV not in env_of(ctr)
    assert "compaction-keys" not in {v["name"] for v in pod_spec(objects, "codec")["volumes"]}
    assert (
        "checksum/compaction-keys"
        not in deployment(objects, "codec")["spec"]["template"]["metadata"]["annotations"]
    )


@pytest.mark.parametrize(
    ("values", "warned"),
    [
        ({}, True),  # the defaults: autoscaling, 2 to 8 codec pods
        ({"codec": {"replicas": 3, "autoscaling": {"enabled": False}}}, True),
        ({"codec": {"replicas": 1, "autoscaling": {"enabled": False}}}, False),
        ({"responses": {"compactionKeys": {"allowEphemeral": True}}}, False),
        (WITH_KEYS, False),
    ],
)
def test_notes_warn_when_codec_pods_would_each_have_their_own_key(
    values: dict[str, Any], warned: bool
) -> None:
    """A warning, not a refusal: a refusal would break the chart's default render (autoscaling on)."""
    render(values)  # renders either way
    notes = render_notes(values)
    assert (WARNING in notes) is warned
    if values is WITH_KEYS:
        assert f"Compaction keys (/v1/responses/compact): Secret {SECRET} (key compaction-keys)" in notes


def test_the_config_key_is_refused_under_config() -> None:
    with pytest.raises(helm_error(), match=r"config\.responses\.compaction_keys_file.*compactionKeys"):
        render({"config": {"responses": {"compaction_keys_file": "/keys"}}})


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"responses": {"compactionKeys": {"existingSecrets": "x"}}}, "existingSecrets"),
        ({"responses": {"compactionKeys": {"key": "a/b"}}}, "key"),
        ({"responses": {"compactionKeys": {"key": ""}}}, "key"),
        ({"responses": {"compactionKeys": {"allowEphemeral": "yes"}}}, "allowEphemeral"),
        ({"responses": {"compaction_keys_file": "/keys"}}, "compaction_keys_file"),
    ],
)
def test_values_schema_refuses_mistakes(values: dict[str, Any], complaint: str) -> None:
    import helm_python as helm

    with helm.Chart.load(chart.CHART_DIR) as loaded, pytest.raises(helm.HelmError, match=complaint):
        loaded.validate_schema(loaded.merge_values(values))


LOOKUP = 'lookup "v1" "Secret" .Release.Namespace $ck.existingSecret'


def render_with_cluster_secret(tmp_path: Path, data: dict[str, str] | None) -> dict[str, str]:
    """The codec pod's annotations as `helm upgrade` would render them with `data` as the Secret's data in
    the cluster (None: no such Secret). helm-python has no cluster, so a copy of the chart stands a value
    in for the lookup; values.schema.json is left out of the copy, which would refuse that value."""
    import helm_python as helm

    copy = tmp_path / "chart"
    shutil.copytree(chart.CHART_DIR, copy)
    helpers = copy / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    assert text.count(LOOKUP) == 1, "the checksum helper changed: update this test"
    helpers.write_text(text.replace(LOOKUP, "(index .Values.lookupStub)"))
    (copy / "values.schema.json").unlink()
    values = {**chart.with_base(WITH_KEYS), "lookupStub": {} if data is None else {"data": data}}
    with helm.Chart.load(copy) as loaded:
        manifests = loaded.render(values, name=chart.RELEASE, namespace=chart.NAMESPACE, is_upgrade=True)
    objects = [o for p, t in manifests.items() if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    return deployment(objects, "codec")["spec"]["template"]["metadata"]["annotations"]


def test_a_changed_secret_rolls_the_codec_on_upgrade(tmp_path: Path) -> None:
    one = base64.b64encode(b"k1:" + base64.b64encode(os.urandom(32))).decode()
    two = base64.b64encode(b"k2:" + base64.b64encode(os.urandom(32))).decode()
    before = render_with_cluster_secret(tmp_path / "a", {"compaction-keys": one})
    same = render_with_cluster_secret(tmp_path / "b", {"compaction-keys": one, "unrelated": "eA=="})
    after = render_with_cluster_secret(tmp_path / "c", {"compaction-keys": two})
    assert before["checksum/compaction-keys"] == same["checksum/compaction-keys"]
    assert before["checksum/compaction-keys"] != after["checksum/compaction-keys"]
    assert one not in str(before) and len(before["checksum/compaction-keys"]) == 64
    # No Secret in the cluster yet (or `helm template`): no annotation, and the pod waits for its volume.
    assert "checksum/compaction-keys" not in render_with_cluster_secret(tmp_path / "d", None)
