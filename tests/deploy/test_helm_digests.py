"""Images pinned by digest (issue 55): every image the chart renders (codec, router, workers of either
variant, the init containers that fetch and verify the model, the bundled Redis of quotas and Responses,
of the KV tiers and of the queue, the batch store's PostgreSQL) can carry `digest`, rendered as
`repository:tag@sha256:...`, and every object stays valid Kubernetes; without digests nothing is pinned;
a malformed digest is refused by the schema."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.chart import containers_of, fullname, helm_error, render, validation_errors

DIGEST = "sha256:" + "ab" * 32
REDIS_DIGEST = "sha256:" + "cd" * 32
PG_DIGEST = "sha256:" + "ef" * 32
EVERYTHING = {
    "gpu": {"enabled": False},
    "queue": {"enabled": True},
    "batches": {"enabled": True},
    "kvTiers": {"enabled": True},
    "model": {"verify": {"enabled": True}, "fetch": {"enabled": True, "command": ["sh", "-c", "true"]}},
}
PINNED = {
    **EVERYTHING,
    "image": {
        "registry": "ghcr.io/acme",
        "codec": {"repository": "kvrelay-codec", "digest": DIGEST},
        "router": {"repository": "kvrelay-router", "digest": DIGEST},
        "worker": {"repository": "kvrelay-worker", "digest": DIGEST},
    },
    "queue": {"enabled": True, "redis": {"image": {"digest": REDIS_DIGEST}}},
    "batches": {"enabled": True, "store": {"image": {"digest": PG_DIGEST}}},
    "kvTiers": {"enabled": True, "cacheRedis": {"image": {"digest": REDIS_DIGEST}}},
    "redis": {"image": {"digest": REDIS_DIGEST}},
}


def images(objects: list[dict]) -> dict[str, str]:
    """Every container's image (init containers too), by "<object>/<container>"."""
    return {
        f"{obj['metadata']['name']}/{ctr['name']}": ctr["image"]
        for obj in objects
        if obj["kind"] in ("Deployment", "StatefulSet", "Job", "LeaderWorkerSet")
        for ctr in containers_of(obj)
    }


def test_every_image_is_pinned_by_its_digest() -> None:
    objects = render(PINNED)
    found = images(objects)
    assert len(found) >= 8, found
    for where, image in found.items():
        repository_tag, _, digest = image.partition("@")
        assert digest in (DIGEST, REDIS_DIGEST, PG_DIGEST), (where, image)
        assert ":" in repository_tag, (where, image)  # the tag stays, for people reading the manifest
    assert found[f"{fullname('codec')}/codec"].startswith("ghcr.io/acme/kvrelay-codec:")
    assert found[f"{fullname('decode')}/fetch-model"] == found[f"{fullname('decode')}/worker"]
    assert any(
        i.startswith("ghcr.io/acme/kvrelay-worker:") and i.endswith(f"-cpu@{DIGEST}") for i in found.values()
    )
    assert any(i == f"postgres:17.6-bookworm@{PG_DIGEST}" for i in found.values())
    assert sum(i == f"redis:7.4.6-alpine@{REDIS_DIGEST}" for i in found.values()) == 3  # quotas, tiers, queue
    for obj in objects:
        assert validation_errors(obj) == [], obj["metadata"]["name"]


def test_without_digests_nothing_is_pinned() -> None:
    assert not [i for i in images(render(EVERYTHING)).values() if "@" in i]


@pytest.mark.parametrize(
    "values",
    [
        {"image": {"codec": {"repository": "kvrelay-codec", "digest": "sha256:short"}}},
        {"image": {"worker": {"repository": "kvrelay-worker", "digest": "ab" * 32}}},  # no algorithm
        {"redis": {"image": {"digest": "sha512:" + "ab" * 64}}},
    ],
)
def test_a_malformed_digest_is_refused(values: dict[str, Any]) -> None:
    with pytest.raises(helm_error(), match="digest"):
        render(values)
