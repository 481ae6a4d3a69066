"""metric_sum over two real prometheus_client registries: counters and histograms summed, gauges per replica."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from layerserve.transports.ray.metric_sum import collect_families, exposition


def test_counters_and_histograms_are_summed_and_gauges_labelled_per_replica() -> None:
    by_replica = {}
    for index, (count, memory, seconds) in enumerate([(3, 100.0, 0.5), (4, 250.0, 2.0)]):
        registry = CollectorRegistry()
        requests = Counter("demo_requests", "Requests.", ["model"], registry=registry)
        requests.labels("m").inc(count)
        Gauge("demo_memory_bytes", "Memory.", registry=registry).set(memory)
        Histogram("demo_seconds", "Seconds.", buckets=(1.0,), registry=registry).observe(seconds)
        by_replica[f"node{index}/replica{index}"] = collect_families(registry)
    samples = [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(exposition(by_replica).decode())
        for sample in family.samples
    ]
    assert ("demo_requests_total", {"model": "m"}, 7.0) in samples
    assert ("demo_memory_bytes", {"node": "node0", "replica": "replica0"}, 100.0) in samples
    assert ("demo_memory_bytes", {"node": "node1", "replica": "replica1"}, 250.0) in samples
    assert ("demo_seconds_bucket", {"le": "1.0"}, 1.0) in samples
    assert ("demo_seconds_bucket", {"le": "+Inf"}, 2.0) in samples
    assert ("demo_seconds_sum", {}, 2.5) in samples
    assert ("demo_seconds_count", {}, 2.0) in samples
