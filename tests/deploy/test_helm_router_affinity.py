"""The chart's routers agree on each session's home (issue 55, docs/routing.md): the config every router
reads says `router.affinity: shared` (rendezvous hashing) unless `config.router.affinity` says otherwise,
and other router settings the user gives are kept beside it."""

from __future__ import annotations

import yaml

from tests.deploy.chart import config_yaml, render


def test_the_chart_routers_share_their_affinity_by_default() -> None:
    assert yaml.safe_load(config_yaml(render({})))["router"] == {"affinity": "shared"}


def test_a_users_router_settings_win_and_are_kept() -> None:
    values = {"config": {"router": {"affinity": "local", "tier_aware": False}}}
    assert yaml.safe_load(config_yaml(render(values)))["router"] == {"affinity": "local", "tier_aware": False}
    values = {"config": {"router": {"prefill_tokens_per_s": 5000}}}
    router = yaml.safe_load(config_yaml(render(values)))["router"]
    assert router == {"affinity": "shared", "prefill_tokens_per_s": 5000}
