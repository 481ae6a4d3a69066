"""GET /v2/overview (the console's one document) against a real server: every model with its versions, states and
reasons; request counts and latency histograms that grow by what was sent; processes; the summary of a
Prometheus text with several workers' and replicas' series. And the console's page, files and `/` redirect."""

from __future__ import annotations

import httpx
import numpy as np

from layerserve.transports.http.overview import summarize
from tests.conftest import API_TOKEN
from tests.live_server import LiveServer


def _mlp_requests(server: LiveServer, count: int) -> None:
    body = {"inputs": [{"name": "x", "shape": [2, 10], "datatype": "FP32", "data": np.ones(20).tolist()}]}
    with httpx.Client(base_url=server.url) as client:
        for _ in range(count):
            assert client.post("/v2/models/mlp/versions/1/infer", json=body).status_code == 200
        assert client.post("/v2/models/mlp/versions/1/infer", json={"inputs": []}).status_code == 400


def test_the_overview_counts_what_was_sent(server: LiveServer) -> None:
    before = httpx.get(f"{server.url}/v2/overview").json()
    _mlp_requests(server, 7)
    after = httpx.get(f"{server.url}/v2/overview").json()
    was, now = before["series"].get("mlp"), after["series"]["mlp"]
    assert now["requests"] - (was["requests"] if was else 0) == 8
    assert now["client_errors"] - (was["client_errors"] if was else 0) == 1
    latency = now["latency_s"]
    assert latency["count"] - (was["latency_s"]["count"] if was else 0) == 8
    assert latency["buckets"] == sorted(latency["buckets"]) and latency["buckets"][-1][1] <= latency["count"]
    assert now["batch_size"]["count"] >= 1 and now["compute_s"]["count"] == now["batch_size"]["count"]
    assert after["server"]["ready"] is True and after["server"]["time"] > before["server"]["time"]
    assert after["processes"] and after["processes"][0]["rss_bytes"] > 50 * 2**20
    assert after["processes"][0]["cpu_s"] > 0


def test_the_overview_lists_every_model_with_its_versions_states_and_reasons(server: LiveServer) -> None:
    models = {row["name"]: row for row in httpx.get(f"{server.url}/v2/overview").json()["models"]}
    mlp = models["mlp"]
    assert [v["version"] for v in mlp["versions"]] == ["1", "2"] and mlp["active_version"] == "2"
    assert {v["state"] for v in mlp["versions"]} == {"READY"}
    assert mlp["versions"][0]["engine"] == "onnx" and mlp["versions"][0]["input"] == "tensor"
    assert mlp["versions"][0]["batching"]["max_batch_size"] >= 1
    assert models["corrupt"]["versions"][0]["state"] == "FAILED" and models["corrupt"]["versions"][0]["reason"]
    assert models["misconfigured"]["versions"] == [] and "max_batch_sise" in models["misconfigured"]["reason"]


def test_summarize_keeps_processes_apart_and_sums_models() -> None:
    text = "\n".join([
        '# TYPE layerserve_requests_total counter',
        'layerserve_requests_total{model="m",route="v2.infer",status="200",version="1"} 5.0',
        'layerserve_requests_total{model="m",route="v2.infer",status="503",version="1"} 2.0',
        'layerserve_requests_total{model="",route="other",status="200",version=""} 9.0',
        '# TYPE layerserve_request_seconds histogram',
        'layerserve_request_seconds_bucket{le="0.01",model="m",route="v2.infer"} 3.0',
        'layerserve_request_seconds_bucket{le="0.1",model="m",route="v2.infer"} 6.0',
        'layerserve_request_seconds_bucket{le="+Inf",model="m",route="v2.infer"} 7.0',
        'layerserve_request_seconds_bucket{le="0.01",model="m",route="v2.meta"} 1.0',
        'layerserve_request_seconds_bucket{le="0.1",model="m",route="v2.meta"} 1.0',
        'layerserve_request_seconds_bucket{le="+Inf",model="m",route="v2.meta"} 1.0',
        'layerserve_request_seconds_count{model="m",route="v2.infer"} 7.0',
        'layerserve_request_seconds_count{model="m",route="v2.meta"} 1.0',
        'layerserve_request_seconds_sum{model="m",route="v2.infer"} 0.2',
        '# TYPE layerserve_queued_requests gauge',
        'layerserve_queued_requests{model="m",version="1",pid="11"} 2.0',
        'layerserve_queued_requests{model="m",version="1",pid="12"} 1.0',
        '# TYPE layerserve_process_resident_memory_bytes gauge',
        'layerserve_process_resident_memory_bytes{pid="11"} 100.0',
        'layerserve_process_resident_memory_bytes{pid="12"} 200.0',
        'layerserve_process_resident_memory_bytes{node="abcdef0123456789",replica="r1"} 300.0',
        '# TYPE layerserve_gpu_memory_used_bytes gauge',
        'layerserve_gpu_memory_used_bytes{device="0"} 1024.0',
        "",
    ])  # fmt: skip
    summary = summarize(text)
    m = summary["models"]["m"]
    assert (m["requests"], m["server_errors"], m["client_errors"], m["queued"]) == (7, 2, 0, 3)
    assert m["latency_s"] == {"buckets": [(0.01, 4.0), (0.1, 7.0)], "count": 8.0, "sum": 0.2}
    assert "" not in summary["models"]
    assert [(p["id"], p["rss_bytes"]) for p in summary["processes"]] == [
        ("abcdef01/r1", 300.0), ("pid 11", 100.0), ("pid 12", 200.0)
    ]  # fmt: skip
    assert summary["gpus"] == [{"device": "0", "used_bytes": 1024.0}]


def test_browsers_asking_for_the_root_go_to_the_console(server: LiveServer) -> None:
    redirected = httpx.get(f"{server.url}/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert redirected.status_code == 307 and redirected.headers["location"] == "/console"
    plain = httpx.get(f"{server.url}/")
    assert plain.status_code == 404 and "/console" in plain.json()["error"]
    page = httpx.get(f"{server.url}/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/console/static/app.js">' in page.text
    script = httpx.get(f"{server.url}/console/static/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    missing = httpx.get(f"{server.url}/console/static/nothing.js")
    assert missing.status_code == 404 and "error" in missing.json()


def test_the_console_page_is_public_and_its_data_needs_the_token(guarded_server: LiveServer) -> None:
    assert httpx.get(f"{guarded_server.url}/console").status_code == 200
    assert httpx.get(f"{guarded_server.url}/console/static/console.css").status_code == 200
    refused = httpx.get(f"{guarded_server.url}/v2/overview")
    assert refused.status_code == 401 and "token" in refused.json()["error"]
    answer = httpx.get(f"{guarded_server.url}/v2/overview", headers={"Authorization": f"Bearer {API_TOKEN}"})
    assert answer.status_code == 200 and {row["name"] for row in answer.json()["models"]} == {"mlp", "slow"}
