"""The grey release's shape on real processes (issue 55, docs/deploy.md "Grey release"): a main codec and a
canary codec sharing one real Redis (stored Responses under one key prefix) and one compaction key file, in
front of the running stack's router, through the strict openai SDK. A stored Response made through the main
codec continues (`previous_response_id`) and is retrieved through the canary; a compaction item sealed by
the main codec opens on the canary serving the same model name, and a canary serving another name refuses
it with the documented 400 naming `input[0].encrypted_content`. And `kvrelay canary` reports both from a real
Prometheus scraping the two codecs."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import TOKEN, RunningStack, wait_http_ready
from tests.stack_helpers import Proc, free_port, stack_env, wait_until

pytestmark = pytest.mark.model

REDIS_URL = "redis://127.0.0.1:6379/1"
NAME = "smollm2"
MAIN, CANARY = "kvrelay", "kvrelay-next"  # the releases the two codecs stand for
ENSURE_PROMTOOL = Path(__file__).resolve().parents[2] / "scripts" / "ensure_promtool.sh"


@pytest.fixture(scope="module")
def codecs(
    stack: RunningStack, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """Three codecs on the stack's router: main and canary serving NAME, and a canary serving another name;
    all share one Redis key prefix (fresh per run) and one compaction key file."""
    logs = tmp_path_factory.mktemp("grey-release")
    keys = logs / "compaction-keys"
    keys.write_text(f"k1:{base64.b64encode(os.urandom(32)).decode()}\n")
    shared = {
        "KVRELAY_RESPONSES__REDIS_URL": REDIS_URL,
        "KVRELAY_RESPONSES__KEY_PREFIX": f"kvrelay:test-grey-{uuid.uuid4().hex[:8]}:",
        "KVRELAY_RESPONSES__COMPACTION_KEYS_FILE": str(keys),
        "KVRELAY_RESPONSES__COMPACTION_MAX_OUTPUT_TOKENS": "16",
        "KVRELAY_MODEL__DTYPE": "float32",
    }
    procs, urls = [], {}
    try:
        for role, served in (("main", NAME), ("canary", NAME), ("renamed", f"{NAME}-other")):
            port = free_port()
            env = stack_env(TOKEN, KVRELAY_MODEL__SERVED_NAME=served, **shared)
            command = ["codec", "--model", str(model_dir), "--router", stack.router_address]
            command += ["--port", str(port)]
            procs.append(Proc(command, env, logs / f"{role}.log"))
            urls[role] = f"http://127.0.0.1:{port}"
        for proc, url in zip(procs, urls.values(), strict=True):
            wait_http_ready(url, proc)
        yield urls
    finally:
        for proc in procs:
            proc.stop()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True)


def turn(api: OpenAI, text: str, **extra: Any) -> Any:
    return api.responses.create(model=NAME, input=text, temperature=0, max_output_tokens=8, **extra)


def test_a_stored_response_continues_and_is_found_through_the_other_codec(codecs: dict[str, str]) -> None:
    main, canary = client(codecs["main"]), client(codecs["canary"])
    first = turn(main, "What is the capital of France?", store=True)
    found = canary.responses.retrieve(first.id)
    assert found.id == first.id and found.output_text == first.output_text
    second = turn(canary, "And of Italy?", previous_response_id=first.id, store=True)
    assert second.previous_response_id == first.id and second.usage is not None
    alone = turn(canary, "And of Italy?", store=False)
    assert alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens, "the first turn is in the prompt"
    assert main.responses.retrieve(second.id).previous_response_id == first.id  # and back again


def test_a_compaction_opens_on_a_codec_of_the_same_name_and_not_another(codecs: dict[str, str]) -> None:
    main = client(codecs["main"])
    first = turn(main, "Remember the number 7.", store=True)
    compacted = main.responses.compact(model=NAME, previous_response_id=first.id)
    window = [item.model_dump(exclude_none=True) for item in compacted.output]
    assert window[0]["type"] == "compaction"
    follow_up = [*window, {"role": "user", "content": "Which number?"}]
    reply = client(codecs["canary"]).responses.create(
        model=NAME, input=follow_up, store=False, temperature=0, max_output_tokens=8
    )
    assert reply.status in ("completed", "incomplete") and reply.usage is not None
    with pytest.raises(openai.BadRequestError) as refused:
        client(codecs["renamed"]).responses.create(
            model=f"{NAME}-other", input=follow_up, store=False, max_output_tokens=8
        )
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "input[0].encrypted_content", body
    assert "cannot be opened by this server for this tenant and model" in body["message"]
    health = httpx.get(f"{codecs['renamed']}/ready", timeout=5.0)
    assert health.status_code == 200  # refused cleanly, still serving


# -- kvrelay canary, against a real Prometheus scraping both codecs --------------------------------------


@pytest.fixture(scope="module")
def prometheus(codecs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus (Debian's, beside the promtool scripts/ensure_promtool.sh provides) scraping the
    main and canary codecs every second, labelled with their Services as the ServiceMonitor's are."""
    found = subprocess.run(["bash", str(ENSURE_PROMTOOL)], capture_output=True, text=True, timeout=900)
    assert found.returncode == 0, found.stderr
    binary = Path(found.stdout.strip().splitlines()[-1]).with_name("prometheus")
    assert binary.is_file(), f"no prometheus beside {binary.parent}/promtool"
    home = tmp_path_factory.mktemp("prometheus")
    targets = [
        {"targets": [codecs[role].removeprefix("http://")], "labels": {"service": f"{release}-codec"}}
        for role, release in (("main", MAIN), ("canary", CANARY))
    ]
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "codecs", "static_configs": targets}],
    }
    (home / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    command = [
        str(binary),
        f"--config.file={home / 'prometheus.yml'}",
        f"--storage.tsdb.path={home / 'data'}",
    ]
    command.append(f"--web.listen-address=127.0.0.1:{port}")
    with open(home / "log", "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: scalar(url, "count(up == 1)") == 2, 60, "Prometheus scraping both codecs")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def scalar(prometheus: str, promql: str) -> float | None:
    try:
        reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=5.0).json()
    except httpx.HTTPError:
        return None
    result = reply.get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def canary_report(prometheus: str, canary: str, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "services.cli.main", "canary", "--prometheus", prometheus]
    command += ["--main", MAIN, "--canary", canary, "--window", "1m", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_kvrelay_canary_reports_both_releases_from_prometheus(
    codecs: dict[str, str], prometheus: str
) -> None:
    def scraped(release: str) -> float:
        return scalar(prometheus, f'sum(kvrelay_requests_total{{service="{release}-codec"}})') or 0.0

    before = {release: scraped(release) for release in (MAIN, CANARY)}
    for role, count in (("main", 3), ("canary", 2)):
        for _ in range(count):
            turn(client(codecs[role]), "Hello", store=False)
    for release, count in ((MAIN, 3), (CANARY, 2)):
        wait_until(
            lambda r=release, n=count: scraped(r) >= before[r] + n, 60, f"{release}'s requests scraped"
        )
    report = canary_report(prometheus, CANARY, "--max-latency-ratio", "1000", "--json")
    assert report.returncode == 0, report.stderr
    document = json.loads(report.stdout)
    assert document["verdict"] == "pass", document
    for side in ("main", "canary"):
        figures = document[side]
        assert figures["requests_per_s"] > 0 and figures["error_share"] == 0.0, figures
        assert all(figures["latency_s"][name] > 0 for name in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"))
    silent = canary_report(prometheus, "nobody")
    assert silent.returncode == 3 and "verdict: no_traffic" in silent.stdout, silent.stdout
