"""The Prometheus text and OpenMetrics 1.0 encoders, for the families our servers produce.

Why our own: prometheus_client's encoders re-validate and re-escape every
metric and label name of every sample on every scrape, because they accept
any name (UTF-8 names, several escaping schemes). Ours are catalogued legacy
names, and for them that work is most of the cost of encoding: for a rank's
70 samples ours is about 2.5 times as fast for text and 7 times for OpenMetrics
(what Prometheus asks for); the figures and their command are in
bench/RESULTS.md, "/metrics encoding". The output is byte for byte the library's
(tests/test_exposition.py compares them on every server's registry and on
edge cases), and anything these encoders do not handle — a name outside the
legacy character set, an exemplar, a native histogram, an escaping scheme
other than the default, OpenMetrics 2.0 — goes to the library's encoder, on
families collected once (a collect runs the collectors).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import exposition
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _untyped_go_float

_LEGACY_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LEGACY_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
# Escapings under which the library writes a legacy name unchanged ("dots" doubles its
# underscores, "values" prefixes OpenMetrics sample names with U__).
_NEUTRAL_ESCAPINGS = (openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8)
# Samples the text format moves out of their family into a gauge of their own.
_OM_ONLY_SUFFIXES = ("_created", "_gsum", "_gcount")
_INF = float("inf")
_LABEL_TEXT: dict[tuple[tuple[str, str], ...], str] = {}
_SERIES_TEXT: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
_HEADER_TEXT: dict[tuple[str, str, str, str, bool], str] = {}
_LABEL_TEXT_MAX = 20_000
_TEXT_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram",
               "unknown": "untyped"}


def _go_float(value: float) -> str:
    """A sample value as the library writes it (``+Inf``, ``NaN``, ``1.234567e+06``).

    Every finite value below 1e6 it writes as ``repr``; the rest (exponents for
    large values, the infinities, NaN) it decides itself.
    """
    number = float(value)
    if -_INF < number < 1e6:
        return repr(number)
    return str(_untyped_go_float(number))  # type: ignore[no-untyped-call]


class _Unsupported(Exception):
    """Something only the library's encoder writes correctly; fall back to it."""


@functools.lru_cache(maxsize=4096)
def _metric_name(name: str) -> str:
    if not _LEGACY_METRIC_NAME.match(name):
        raise _Unsupported(name)
    return name


@functools.lru_cache(maxsize=1024)
def _label_name(name: str) -> str:
    if not _LEGACY_LABEL_NAME.match(name):
        raise _Unsupported(name)
    return name


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    # Label sets repeat from scrape to scrape (they are the series), so each is
    # escaped and joined once; the cache is bounded like the series themselves.
    key = tuple(sorted(labels.items()))
    text = _LABEL_TEXT.get(key)
    if text is None:
        if len(_LABEL_TEXT) >= _LABEL_TEXT_MAX:
            _LABEL_TEXT.clear()
        text = "{" + ",".join(f'{_label_name(k)}="{_label_value(v)}"' for k, v in key) + "}"
        _LABEL_TEXT[key] = text
    return text


def _series(name: str, labels: dict[str, str]) -> str:
    """``name{labels}`` of a sample, escaped and joined once per series.

    Keyed by the labels in the order the family gave them (a family gives its
    labels in one order), to spare the sort that the label text's own key takes.
    """
    key = (name, tuple(labels.items()))
    text = _SERIES_TEXT.get(key)
    if text is None:
        if len(_SERIES_TEXT) >= _LABEL_TEXT_MAX:
            _SERIES_TEXT.clear()
        text = _metric_name(name) + _labels(labels)
        _SERIES_TEXT[key] = text
    return text


def _header(metric: Metric, openmetrics: bool) -> str:
    """A family's HELP, TYPE (and UNIT) lines, written once per family and format."""
    key = (metric.name, metric.type, metric.documentation, metric.unit, openmetrics)
    text = _HEADER_TEXT.get(key)
    if text is None:
        if len(_HEADER_TEXT) >= _LABEL_TEXT_MAX:
            _HEADER_TEXT.clear()
        text = _openmetrics_header(metric) if openmetrics else _text_header(metric)
        _HEADER_TEXT[key] = text
    return text


def _text_header(metric: Metric) -> str:
    base = _metric_name(metric.name)
    name = base + "_total" if metric.type == "counter" else \
        base + "_info" if metric.type == "info" else base
    mtype = _TEXT_TYPES.get(metric.type, metric.type)
    return f"# HELP {name} {_text_help(metric)}\n# TYPE {name} {mtype}\n"


def _text_help(metric: Metric) -> str:
    return metric.documentation.replace("\\", "\\\\").replace("\n", "\\n")


def _openmetrics_header(metric: Metric) -> str:
    name = _metric_name(metric.name)
    text = f"# HELP {name} {_label_value(metric.documentation)}\n# TYPE {name} {metric.type}\n"
    if metric.unit:
        text += f"# UNIT {name} {metric.unit}\n"
    return text


def _check_plain(sample: object) -> None:
    if getattr(sample, "exemplar", None) is not None or \
            getattr(sample, "native_histogram", None) is not None:
        raise _Unsupported("exemplar or native histogram")


def encode_text(families: Iterable[Metric]) -> bytes:
    """Prometheus text format 0.0.4, as ``prometheus_client.generate_latest`` writes it."""
    out: list[str] = []
    append = out.append
    for metric in families:
        base = _metric_name(metric.name)
        append(_header(metric, openmetrics=False))
        moved: dict[str, list[str]] = {}
        for sample in metric.samples:
            _check_plain(sample)
            line = f"{_series(sample.name, sample.labels)} {_go_float(sample.value)}"
            if sample.timestamp is not None:
                line += f" {int(float(sample.timestamp) * 1000):d}"
            line += "\n"
            suffix = sample.name[len(base):] if sample.name.startswith(base) else ""
            if suffix in _OM_ONLY_SUFFIXES:
                moved.setdefault(suffix, []).append(line)
            else:
                append(line)
        for suffix, lines in sorted(moved.items()):
            append(f"# HELP {base}{suffix} {_text_help(metric)}\n# TYPE {base}{suffix} gauge\n")
            out.extend(lines)
    return "".join(out).encode()


def encode_openmetrics(families: Iterable[Metric]) -> bytes:
    """OpenMetrics 1.0 text, as ``prometheus_client.openmetrics`` writes it."""
    out: list[str] = []
    append = out.append
    for metric in families:
        append(_header(metric, openmetrics=True))
        for sample in metric.samples:
            _check_plain(sample)
            value = "" if sample.value is None else _go_float(sample.value)
            timestamp = "" if sample.timestamp is None else f" {sample.timestamp}"
            append(f"{_series(sample.name, sample.labels)} {value}{timestamp}\n")
    append("# EOF\n")
    return "".join(out).encode()


class CollectedFamilies(Collector):
    """Families already collected, served as they are: to the library's encoders
    (a collect runs the collectors, so a scrape collects once), and by the prober,
    whose registry per probe holds one outcome."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _fast_encoder(encoder: Callable[[Collector], bytes]) -> Callable[[list[Metric]], bytes] | None:
    """Ours for what ``choose_encoder`` picked, when ours writes the same bytes."""
    if encoder is exposition.generate_latest:
        return encode_text
    if encoder is openmetrics.generate_latest:  # as older prometheus_client versions hand it
        return encode_openmetrics
    if not isinstance(encoder, functools.partial) or encoder.args:
        return None
    keywords = encoder.keywords
    if keywords.get("escaping", openmetrics.UNDERSCORES) not in _NEUTRAL_ESCAPINGS:
        return None
    if encoder.func is exposition.generate_latest and set(keywords) <= {"escaping"}:
        return encode_text
    if encoder.func is openmetrics.generate_latest and set(keywords) <= {"escaping", "version"} \
            and str(keywords.get("version", "1.0.0")).split(".")[0] in ("0", "1"):
        return encode_openmetrics
    return None


def encode(registry: Collector, accept: str) -> tuple[bytes, str]:
    """The registry's metrics in the format ``accept`` asks for, and its content type."""
    encoder, content_type = exposition.choose_encoder(accept)
    fast = _fast_encoder(encoder)
    if fast is None:
        return encoder(registry), content_type
    families = list(registry.collect())
    try:
        return fast(families), content_type
    except _Unsupported:
        return encoder(CollectedFamilies(families)), content_type
