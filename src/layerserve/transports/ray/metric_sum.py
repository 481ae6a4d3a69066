"""Prometheus metrics of several replicas as one text: counters, histograms and summaries summed over the
replicas; gauges (a process's CPU, memory, in-flight requests, model states) kept per replica, with `replica`
and `node` labels."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

Sample = tuple[str, dict[str, str], float]
Family = tuple[str, str, str, list[Sample]]  # name, type, documentation, samples
Families = list[Family]

_SUMMED = {"counter", "histogram", "summary"}


def collect_families(registry: CollectorRegistry) -> Families:
    """A registry's metrics as plain values (to send to another process)."""
    return [
        (metric.name, metric.type, metric.documentation, [(s.name, dict(s.labels), s.value) for s in metric.samples])
        for metric in registry.collect()
    ]


def merge(by_replica: Mapping[str, Families]) -> list[Metric]:
    """One family per name over every replica (`<node id>/<replica id>` -> its families); see the module."""
    merged: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for identity, families in sorted(by_replica.items()):
        node, _, replica = identity.partition("/")
        for name, kind, documentation, samples in families:
            metric = merged.setdefault(name, Metric(name, documentation, kind))
            if kind not in _SUMMED:
                for sample, labels, value in samples:
                    metric.add_sample(sample, {**labels, "replica": replica, "node": node}, value)
                continue
            totals = sums.setdefault(name, {})
            for sample, labels, value in samples:
                key = (sample, tuple(sorted(labels.items())))
                if sample.endswith("_created"):  # when the series began: the earliest replica's
                    totals[key] = min(totals.get(key, value), value)
                else:
                    totals[key] = totals.get(key, 0.0) + value
    for name, totals in sums.items():
        for (sample, pairs), value in totals.items():
            merged[name].add_sample(sample, dict(pairs), value)
    return list(merged.values())


class _Merged:
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics


def exposition(by_replica: Mapping[str, Families]) -> bytes:
    """The Prometheus text format of `merge(by_replica)`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(merge(by_replica)))
    return generate_latest(registry)
