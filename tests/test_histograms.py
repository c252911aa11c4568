"""The labelled histogram the prober and the chat helper share (histograms.py) counts
as prometheus_client's Histogram does: cumulative buckets, sum and count."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from colossalai_exporter.histograms import LabelledHistogram


def test_the_same_observations_give_prometheus_clients_samples() -> None:
    bounds = (0.1, 0.5, 1.0, 5.0)
    ours = LabelledHistogram(bounds)
    registry = CollectorRegistry()
    theirs = Histogram("colossalai_probe_duration_seconds", "d", ["module"], buckets=bounds,
                       registry=registry)
    for module, value in [("chat", 0.05), ("chat", 0.5), ("chat", 7.0), ("tcp", 1.0)]:
        ours.observe((module,), value)
        theirs.labels(module).observe(value)
    family = ours.family("colossalai_probe_duration_seconds", ours.snapshot(),
                         also=[("http",)])
    mine = {(s.name, tuple(sorted(s.labels.items())), s.value) for s in family.samples}
    reference = {(s.name, tuple(sorted(s.labels.items())), s.value)
                 for metric in registry.collect() for s in metric.samples
                 if not s.name.endswith("_created")}
    assert reference <= mine
    # the pre-created module is there at zero, and nothing else is extra
    extra = mine - reference
    assert extra and all(dict(labels)["module"] == "http" and value == 0
                         for _, labels, value in extra)


def test_a_snapshot_does_not_move_with_later_observations() -> None:
    hist = LabelledHistogram((1.0,))
    hist.observe(("a",), 0.5)
    snapshot = hist.snapshot()
    hist.observe(("a",), 0.5)
    assert snapshot[("a",)].count == 1 and snapshot[("a",)].buckets == [1, 0]
