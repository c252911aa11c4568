"""The catalogue is well-formed and docs/metrics.md is generated from it."""

from __future__ import annotations

import re

import pytest

import metrics_docs
from colossalai_exporter import catalogue
from conftest import REPO

NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
UNIT_SUFFIX = {"bytes": "_bytes", "seconds": "_seconds", "percent": "_percent",
               "ratio": "_ratio", "celsius": "_celsius", "watts": "_watts"}


def test_names_are_unique_and_follow_conventions() -> None:
    names = [m.name for m in catalogue.CATALOGUE]
    assert len(names) == len(set(names))
    for metric in catalogue.CATALOGUE:
        assert NAME.match(metric.name), metric.name
        assert metric.help.strip(), metric.name
        if metric.type == "counter":
            assert metric.name.endswith("_total"), metric.name
        else:
            assert not metric.name.endswith("_total"), metric.name
        assert (metric.type == "info") == metric.name.endswith("_info"), metric.name
        if metric.unit:
            base = metric.name.removesuffix("_total")
            assert base.endswith(UNIT_SUFFIX[metric.unit]) or base.endswith(
                "_timestamp" + UNIT_SUFFIX[metric.unit]), metric.name
        assert not {"hostname", "host", "cluster", "instance", "job"} & set(metric.labels)
        if metric.component == "training":
            assert metric.labels[:1] == ("rank",), metric.name


def test_family_carries_catalogue_help_and_labels() -> None:
    fam = catalogue.gauge("colossalai_disk_free_bytes")
    fam.add_metric(["checkpoints", "/ckpt"], 5.0)
    assert fam.documentation == catalogue.get("colossalai_disk_free_bytes").help
    assert fam.samples[0].labels == {"name": "checkpoints", "path": "/ckpt"}


def test_typed_accessors_refuse_a_metric_of_another_type() -> None:
    with pytest.raises(TypeError, match="is a gauge, not a counter"):
        catalogue.counter("colossalai_disk_free_bytes")
    with pytest.raises(KeyError, match="not in the catalogue"):
        catalogue.gauge("colossalai_no_such_metric")


def test_metrics_md_is_current() -> None:
    committed = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert committed == metrics_docs.render(), (
        "docs/metrics.md is stale: run python tools/metrics_docs.py")
