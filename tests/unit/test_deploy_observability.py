"""deploy/: the Prometheus alert rules pass `promtool check rules` and their own `promtool test rules`
cases, the Grafana dashboard's queries are valid PromQL, and every metric name (and label) the dashboard
and the alerts use is one a service really exports on /metrics.

promtool comes from scripts/ensure_promtool.sh (which installs Debian's `prometheus` package when it can);
without it these tests fail with the script's message, they do not skip.

The exported names come from scrapes: a codec app (fake backend, real API keys and quotas) served on a
loopback port and driven through successes, a 429, a 401, a 400 and a quota store that is down; a worker's
WorkerMetrics and a router's RouterCollector over stub engine and router state, rendered as the
`--metrics-port` servers render them. The exposition text is parsed with prometheus_client's parser.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.codec.admission.auth import KeyRecord, key_digest, new_key, write_keys_file
from services.codec.text.tokenizer import Tokenizer
from services.common.cache_redis import start_queue_redis, stop_cache_redis
from services.common.config import KvrelayConfig
from services.common.process_metrics import ConnectionsCollector
from services.engine.async_engine import AsyncEngine
from services.engine.core import EngineStats
from services.engine.scheduling.block_pool import BlockPoolStats
from services.kvcache.host_tier import HostTier
from services.kvcache.tier_set import SegmentSize, TierReport, TierSet
from services.router.metrics import RouterCollector
from services.router.router_service import RouterService
from services.router.tier_index import TierIndex
from services.worker.counters import TransferCounters
from services.worker.metrics import WorkerMetrics
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread
from tests.engine_fakes import StubGpu
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvrelay-dashboard.json"
ALERTS = REPO / "deploy" / "prometheus" / "kvrelay-alerts.yaml"
ALERT_TESTS = REPO / "deploy" / "prometheus" / "kvrelay-alerts.test.yaml"
ENSURE_PROMTOOL = REPO / "scripts" / "ensure_promtool.sh"
KEY = "kv1:0123456789abcdef:-:" + "ab" * 32

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SCRAPE_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$tenant": ".*"}

METRIC = re.compile(r"\bkvrelay_[A-Za-z0-9_]*")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
SELECTOR = re.compile(r"\b(kvrelay_[A-Za-z0-9_]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
LABEL_VALUES = re.compile(r"label_values\(\s*(?P<metric>kvrelay_\w+)\s*,\s*(?P<label>\w+)\s*\)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
TYPE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("", "_count", "_sum"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
}


# --- promtool --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    found = subprocess.run(
        ["bash", str(ENSURE_PROMTOOL)], capture_output=True, text=True, timeout=900, check=False
    )
    if found.returncode != 0:
        pytest.fail(f"scripts/ensure_promtool.sh found no promtool:\n{found.stderr.strip()}")
    return found.stdout.strip().splitlines()[-1]


def test_ensure_promtool_prints_an_executable_or_fails_saying_what_to_install(promtool: str) -> None:
    assert Path(promtool).is_file(), promtool
    refused = subprocess.run(
        ["bash", str(ENSURE_PROMTOOL)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PROMTOOL": "/nonexistent/promtool"},
    )
    assert refused.returncode != 0 and refused.stdout == ""
    assert "PROMTOOL=/nonexistent/promtool is not an executable file" in refused.stderr


def run_promtool(promtool: str, *args: str) -> None:
    result = subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False, cwd=REPO
    )
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"


def test_the_alert_rules_pass_promtool_check_rules(promtool: str) -> None:
    run_promtool(promtool, "check", "rules", str(ALERTS))


def test_the_alert_rules_pass_their_promtool_unit_tests(promtool: str) -> None:
    run_promtool(promtool, "test", "rules", str(ALERT_TESTS))


def test_every_alert_has_a_unit_test_where_it_fires() -> None:
    cases = [
        case for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"] for case in test["alert_rule_test"]
    ]
    tested = {case["alertname"] for case in cases}
    fired = {case["alertname"] for case in cases if case.get("exp_alerts")}
    alerts = set(alert_rules())
    assert alerts, "no alerts in the rules file"
    assert alerts - fired == set(), "alerts no test case expects to fire"
    assert tested - alerts == set(), "tests of alerts that do not exist"


def test_the_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Every query, as Prometheus gets it from Grafana, parses (as recording rules for promtool)."""
    rules = [
        {"record": f"kvrelay_dashboard:query_{n}", "expr": grafana_substituted(expr)}
        for n, expr in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool(promtool, "check", "rules", str(path))


# --- the dashboard's shape -------------------------------------------------------------------------------


def test_the_dashboard_uses_the_templated_datasource_and_a_tenant_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    tenant = variables["tenant"]
    assert tenant["datasource"] == DATASOURCE and tenant["includeAll"] and tenant["multi"]
    assert "tenant" in tenant["definition"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"]), "panel ids repeat"
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["description"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
        variables_used = set(re.findall(r"\$\w+", " ".join(t["expr"] for t in panel["targets"])))
        assert variables_used <= set(GRAFANA_VARIABLES), (panel["title"], variables_used)
    tenant_panels = [p for p in panels if any('tenant=~"$tenant"' in t["expr"] for t in p["targets"])]
    assert {p["title"] for p in tenant_panels} >= {
        "Prefix cache hit rate by tenant",
        "Rate limits and admission refusals by tenant",
    }


def test_the_dashboard_covers_what_the_issue_asks_for() -> None:
    queries = " ".join(dashboard_queries())
    for needed in (
        "kvrelay_time_to_first_token_seconds_bucket",
        "kvrelay_inter_token_latency_seconds_bucket",
        "kvrelay_e2e_request_latency_seconds_bucket",
        "kvrelay_worker_waiting_requests",
        "kvrelay_kv_blocks_total",
        "kvrelay_prefix_cache_hit_tokens_total",
        "kvrelay_requests_total",
        "kvrelay_admission_rejections_total",
        "kvrelay_process_resident_memory_bytes",
        "kvrelay_process_open_fds",
        "kvrelay_process_threads",
        "kvrelay_connections",
        "kvrelay_gpu_memory_bytes",
    ):
        assert needed in queries, needed
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(kvrelay_time_to_first_token" in queries
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert any("transfer" in t.lower() and "TTFT" in t for t in titles)


# --- names and labels against real scrapes ---------------------------------------------------------------


@dataclass
class Exported:
    """What the services' /metrics expose: every sample name (families without samples contribute the
    names their type implies) and the label names seen on each sample name."""

    names: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=dict)

    def add(self, exposition: str) -> None:
        for family in text_string_to_metric_families(exposition):
            for suffix in TYPE_SUFFIXES.get(family.type, ("",)):
                self.names.add(family.name + suffix)
            for sample in family.samples:
                self.names.add(sample.name)
                self.labels.setdefault(sample.name, set()).update(sample.labels)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def exported(model_dir: Path, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    exported = Exported()
    keys_dir = tmp_path_factory.mktemp("keys")
    exported.add(scrape_codec_with_quotas(model_dir, tokenizer, keys_dir))
    exported.add(scrape_codec_with_quota_store_down(model_dir, tokenizer))
    exported.add(scrape_codec_with_a_queue(model_dir, tokenizer, tmp_path_factory.mktemp("queue")))
    exported.add(scrape_worker())
    exported.add(scrape_router())
    exported.add(scrape_connections())
    return exported


@pytest.mark.model
def test_the_scrapes_found_every_service(exported: Exported) -> None:
    for name in (
        "kvrelay_time_to_first_token_seconds_bucket",  # codec
        "kvrelay_admission_rejections_total",  # codec admission
        "kvrelay_kv_blocks_total",  # worker
        "kvrelay_router_replica_usable",  # router
    ):
        assert name in exported.names, name
    assert "tenant" in exported.labels["kvrelay_prefix_cache_hit_tokens_total"]


@pytest.mark.model
@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_queried_is_exported(exported: Exported, source: str) -> None:
    used = {name for expr in queries_of(source) for name in metric_names(expr)}
    assert used, f"no kvrelay_ metric in the {source}"
    missing = sorted(used - exported.names)
    assert missing == [], f"{source} queries metrics no service exports: {missing}"


@pytest.mark.model
@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_label_queried_is_on_the_metric(exported: Exported, source: str) -> None:
    """Label matchers name labels of their metric; by/without/on/ignoring name labels of some metric
    in the same query. Prometheus would silently match nothing (or merge everything) otherwise."""
    problems = []
    for expr in queries_of(source):
        bare = STRING.sub('""', expr)
        names = metric_names(expr)
        unseen = sorted(n for n in names if n not in exported.labels)
        if unseen:
            problems.append(f"no samples of {unseen} in the scrapes, so their labels are unknown")
            continue
        for name, matchers in SELECTOR.findall(bare):
            allowed = exported.labels[name] | SCRAPE_LABELS
            for label in MATCHER.findall(matchers):
                if label not in allowed:
                    problems.append(f"{name} has no label {label!r} (has {sorted(allowed)}): {expr}")
        allowed = SCRAPE_LABELS.union(*(exported.labels[n] for n in names))
        for clause in GROUPING.findall(bare):
            for label in filter(None, (part.strip() for part in clause.split(","))):
                if label not in allowed:
                    problems.append(f"no metric in the query has label {label!r}: {expr}")
    assert problems == [], "\n".join(problems)


@pytest.mark.model
def test_the_query_variables_read_exported_labels(exported: Exported) -> None:
    variables = variable_queries()
    assert variables, "the dashboard has no query variable (tenant)"
    for metric, label in variables:
        assert label in exported.labels.get(metric, set()), f"label_values({metric}, {label})"


# --- the scrapes -----------------------------------------------------------------------------------------


def scrape_codec_with_quotas(model_dir: Path, tokenizer: Tokenizer, keys_dir: Path) -> str:
    """Two tenants with keys and two requests a minute each: successes (chat, streamed completion), a 429,
    a 401 without a key and a 400."""
    keys_file = keys_dir / "keys.yaml"
    records, keys = [], {}
    for tenant in ("acme", "globex"):
        key_id, key = new_key()
        records.append(KeyRecord(key_id=key_id, tenant=tenant, sha256=key_digest(key)))
        keys[tenant] = key
    write_keys_file(keys_file, records)
    config = KvrelayConfig.model_validate(
        {"auth": {"keys_file": str(keys_file)}, "quotas": {"default_requests_per_minute": 2}}
    )
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 8}
    with codec_server(model_dir, tokenizer, config) as url:
        acme = {"authorization": f"Bearer {keys['acme']}"}
        globex = {"authorization": f"Bearer {keys['globex']}"}
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.post("/v1/chat/completions", json=chat, headers=acme).status_code == 200
            streamed = {"model": MODEL_NAME, "prompt": "Count.", "max_tokens": 8, "stream": True}
            assert client.post("/v1/completions", json=streamed, headers=acme).status_code == 200
            assert client.post("/v1/chat/completions", json=chat, headers=acme).status_code == 429
            assert (
                client.post("/v1/chat/completions", json={**chat, "n": 0}, headers=globex).status_code == 400
            )
            assert client.post("/v1/chat/completions", json=chat).status_code == 401
            return client.get("/metrics").text


def scrape_codec_with_quota_store_down(model_dir: Path, tokenizer: Tokenizer) -> str:
    """Quotas and the exact-result cache in a Redis nobody listens on, failing open: the request (asking
    for the result cache) is served, a miss, and the errors counted."""
    config = KvrelayConfig.model_validate(
        {
            "quotas": {
                "backend": "redis",
                "redis_url": "redis://127.0.0.1:1/0",
                "fail_open": True,
                "default_requests_per_minute": 5,
            },
            "result_cache": {"url": "redis://127.0.0.1:1/0", "tenants": ["*"]},
        }
    )
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 8}
    use = {"x-kvrelay-result-cache": "use"}
    with codec_server(model_dir, tokenizer, config) as url, httpx.Client(base_url=url, timeout=30) as client:
        reply = client.post("/v1/chat/completions", json={**chat, "temperature": 0}, headers=use)
        assert reply.status_code == 200 and reply.headers["x-kvrelay-result-cache"] == "miss"
        return client.get("/metrics").text


def scrape_codec_with_a_queue(model_dir: Path, tokenizer: Tokenizer, data_dir: Path) -> str:
    """The async lane's queue on a real queue-role Redis, one background response queued (no drainer):
    the queue's gauges once a refresh has read them."""
    port = free_port()
    redis = start_queue_redis(port, str(data_dir))
    config = KvrelayConfig.model_validate(
        {"queue": {"url": f"redis://127.0.0.1:{port}/0", "metrics_refresh_ms": 100}}
    )
    body = {"model": MODEL_NAME, "input": "Count.", "max_output_tokens": 8, "background": True}
    try:
        with (
            codec_server(model_dir, tokenizer, config) as url,
            httpx.Client(base_url=url, timeout=30) as client,
        ):
            assert client.post("/v1/responses", json=body).json()["status"] == "queued"
            deadline = time.monotonic() + 30
            while 'kvrelay_queue_jobs{class="normal",state="queued"} 1.0' not in (
                text := client.get("/metrics").text
            ):
                assert time.monotonic() < deadline, "the queue's gauges never showed the queued job"
                time.sleep(0.05)
            return text
    finally:
        stop_cache_redis(redis)


def codec_server(model_dir: Path, tokenizer: Tokenizer, config: KvrelayConfig) -> AbstractContextManager[str]:
    """A codec app over a fake backend (every answer reports 16 cached prompt tokens), on a loopback
    port; the context gives its base URL."""
    identity = identity_for(model_dir)
    fake = FakeBackend(identity.tokenizer_fingerprint)
    fake.script = scripted([tokenizer.encode(" one two three")], num_cached_tokens=16)
    return serve_in_thread(make_app(tokenizer, fake, identity, config))


class StubEngine:
    """What a worker's metrics read from its engine: a stats snapshot and its KV tiers' counts."""

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=3,
            num_waiting=2,
            kv_blocks=BlockPoolStats(num_total=100, num_active=40, num_cached=10, num_free=50),
            prefix_cache_queries=1000,
            prefix_cache_hits=250,
            num_preemptions=1,
            num_steps=50,
            steps_by_path={"kernels": 45, "gemm": 5},
        )

    def tier_report(self) -> TierReport:
        return tier_report()


def tier_report() -> TierReport:
    """A worker's KV tiers after one segment written to its host tier and read back."""
    tiers = TierSet([HostTier(1 << 20)])
    tiers.put(KEY, b"good-value")
    assert tiers.fetch([KEY], lambda _, value: value, float("inf"), SegmentSize(10, 16)) == [b"good-value"]
    tiers.count_lookup(16, late=False)
    return tiers.report()


def scrape_worker() -> str:
    """A decode worker's `--metrics-port` registry after one step."""
    metrics = WorkerMetrics("decode", "decode-0")
    counters = TransferCounters(bytes_total=4096, remote_prefills_total=2, fallbacks_total=1)
    metrics.watch(cast(AsyncEngine, StubEngine()), counters, weight_bytes=365_000_000)
    metrics.observe_step(0.02, num_tokens=64, queue_times=[0.01], encoder_times=[0.004])
    metrics.watch_device(StubGpu(), lambda: 50 << 30)  # as a GPU worker does
    return generate_latest(metrics.registry).decode()


def scrape_connections() -> str:
    """A codec process's connection gauge (registered by `kvrelay codec` for its listeners)."""
    registry = CollectorRegistry()
    registry.register(ConnectionsCollector({"http": 8000, "grpc": 50051}))
    return generate_latest(registry).decode()


def scrape_router() -> str:
    """A router's `--metrics-port` registry over a stub router: routes, decisions, retries, ejections and
    one replica per role."""
    replicas = [
        SimpleNamespace(name=name, role=role, usable=usable, in_flight=1, queued_tokens=32, cached={b"x"})
        for name, role, usable in (("decode-0", "decode", True), ("prefill-0", "prefill", False))
    ]
    service = SimpleNamespace(
        route_reasons={"prefix_overlap": 3, "lowest_cost": 2},
        decisions={("remote", "remote_cheaper"): 2, ("local", "short_prompt"): 3},
        num_retries=1,
        below_tokens_routed=64,
        replicas=SimpleNamespace(num_ejections=1, replicas=replicas, tiers=TierIndex()),
    )
    registry = CollectorRegistry()
    registry.register(RouterCollector(cast(RouterService, service)))
    return generate_latest(registry).decode()


# --- reading the dashboard and the rules -----------------------------------------------------------------


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard's panels (those in rows too)."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        target["expr"] for panel in iter_panels(dashboard["panels"]) for target in panel.get("targets", [])
    ]


def variable_queries() -> list[tuple[str, str]]:
    """(metric, label) of each `label_values(metric, label)` query variable."""
    found = []
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            match = LABEL_VALUES.fullmatch(text.strip())
            assert match, f"variable {variable['name']}: not label_values(metric, label): {text}"
            found.append((match["metric"], match["label"]))
    return found


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def alert_rules() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {
        rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule
    }


def queries_of(source: str) -> list[str]:
    return dashboard_queries() if source == "dashboard" else list(alert_rules().values())


def grafana_substituted(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """The kvrelay_ metric names a query selects (string literals such as label values left out)."""
    return set(METRIC.findall(STRING.sub('""', expr)))


def test_a_worker_exports_its_kv_tiers() -> None:
    samples = {
        (s.name, s.labels.get("tier", s.labels.get("reason", ""))): s.value
        for family in text_string_to_metric_families(scrape_worker())
        for s in family.samples
        if s.name.startswith("kvrelay_kv_tier")
    }
    assert samples[("kvrelay_kv_tier_hits_total", "host")] == 1
    assert samples[("kvrelay_kv_tier_read_bytes_total", "host")] == len(b"good-value")
    assert samples[("kvrelay_kv_tier_written_bytes_total", "host")] == len(b"good-value")
    assert samples[("kvrelay_kv_tier_used_bytes", "host")] == len(b"good-value")
    assert samples[("kvrelay_kv_tier_up", "host")] == 1
    assert samples[("kvrelay_kv_tier_fetch_seconds_count", "host")] == 1
    assert samples[("kvrelay_kv_tier_fetched_tokens_total", "")] == 16
    assert samples[("kvrelay_kv_tier_writes_dropped_total", "queue")] == 0
