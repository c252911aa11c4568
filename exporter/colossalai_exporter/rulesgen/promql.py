"""Small helpers that write PromQL and Prometheus alert templates.

Kept apart from the rules so that each rule reads as its expression, not as
string plumbing. Nothing here knows a metric name.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable

# Characters RE2 treats as special; job names rarely have them, but a dot must not match anything.
_RE2_SPECIAL = re.compile(r"([.+*?()\[\]{}|^$\\])")


class Selector:
    """Label matchers of one component, e.g. ``job="colossalai-node"``."""

    def __init__(self, matchers: str) -> None:
        self.matchers = matchers.strip().strip("{}").strip()

    def __call__(self, metric: str, *extra: str) -> str:
        """``metric{<component matchers>, <extra>}``; bare ``metric`` without any."""
        parts = [m for m in (self.matchers, *extra) if m]
        return f"{metric}{{{', '.join(parts)}}}" if parts else metric


def regex_alternatives(values: list[str]) -> str:
    """A PromQL regex string literal body matching exactly one of ``values``."""
    # In a double-quoted PromQL string a regex backslash is written twice.
    return "|".join(_RE2_SPECIAL.sub(r"\\\\\1", v) for v in values)


def label_is(label: str, *values: str) -> str:
    """A matcher for ``label`` being one of ``values``: ``label="a"``, ``label=~"a|b"``.

    The values are names written in code (phases, reasons), not text from a config.
    """
    return _matcher(label, values, "=", "=~")


def label_is_not(label: str, *values: str) -> str:
    """A matcher for ``label`` being none of ``values``: ``label!="a"``, ``label!~"a|b"``."""
    return _matcher(label, values, "!=", "!~")


def _matcher(label: str, values: tuple[str, ...], equal: str, regex: str) -> str:
    if not values:
        raise ValueError(f"no value for a matcher on {label!r}")
    if len(values) == 1:
        return f'{label}{equal}"{values[0]}"'
    return f'{label}{regex}"{regex_alternatives(list(values))}"'


def expr(text: str) -> str:
    """A multi-line expression written indented in Python, dedented and trimmed."""
    return textwrap.dedent(text).strip()


def label(name: str) -> str:
    """The alert's own label ``name`` in an annotation template."""
    return "{{ $labels." + name + " }}"


def template_args(match: tuple[str, ...]) -> str:
    """``$labels.job $labels.instance``: the alert's labels ``match`` as template arguments."""
    return " ".join(f"$labels.{name}" for name in match)


def matching(metric: str, match: tuple[str, ...], extra: str = "") -> str:
    """``metric{job=%q,instance=%q}``: a printf format selecting ``metric`` by the alert's
    labels ``match`` (filled by :func:`template_args` of the same labels), then ``extra``."""
    matchers = ",".join(f"{name}=%q" for name in match)
    return f"{metric}{{{matchers}}}{extra}"


def printf_query(promql: str, args: str) -> str:
    """``printf "<promql>" <args> | query``: the template pipeline that runs ``promql``, a
    printf format, filled with ``args`` (template expressions such as ``$labels.run``)."""
    # The format is a Go string literal in the template: its quotes are escaped.
    escaped = promql.replace('"', '\\"')
    return f'printf "{escaped}" {args} | query'


def first_sample(promql: str, args: str, body: str, otherwise: str | None = None) -> str:
    """Template text rendering ``body`` with the first sample ``promql`` returns.

    ``promql`` and ``args`` are as for :func:`printf_query`. Inside ``body``,
    ``.Labels.<name>`` and ``.Value`` are the sample's, as in ``{{ .Labels.type }}``.
    When the query returns nothing: ``otherwise``, or nothing at all when None.
    """
    text = f"{{{{ with {printf_query(promql, args)} }}}}{{{{ with first . }}}}{body}{{{{ end }}}}"
    if otherwise is not None:
        text += f"{{{{ else }}}}{otherwise}"
    return text + "{{ end }}"


def query(metric: str, match: tuple[str, ...], pipe: str, extra: str = "",
          otherwise: str = "unknown", before: str = "") -> str:
    """Template text that queries ``metric`` for the alert's series and formats the first result.

    ``match`` are the alert's labels to select by, ``pipe`` what to do with the
    first sample (``value | humanizeDuration``, ``label "reason"``), ``extra`` a
    PromQL suffix such as `` == 1`` and ``before`` a prefix such as ``time() -``.
    Renders ``otherwise`` when nothing matches.
    """
    pipeline = printf_query(before + matching(metric, match, extra), template_args(match))
    return (f"{{{{ with {pipeline} }}}}{{{{ . | first | {pipe} }}}}"
            f"{{{{ else }}}}{otherwise}{{{{ end }}}}")


def choose(subject: str, cases: Iterable[tuple[str, str]], otherwise: str) -> str:
    """A Go template chain: the text of the first case whose operands ``subject`` equals
    (``eq`` takes several: ``'"a" "b"'``), else ``otherwise``."""
    chain = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq {subject} {operands} }}}}{text}'
                    for i, (operands, text) in enumerate(cases))
    return f"{chain}{{{{ else }}}}{otherwise}{{{{ end }}}}"


def quoted(*values: str) -> str:
    """``"a" "b"``: template string operands."""
    return " ".join(f'"{v}"' for v in values)


def fill(template: str, **values: object) -> str:
    """Replace ``[[name]]`` placeholders (Go templates keep their ``{{ }}``).

    ``[[of_run]]`` is " of run <run>" when the alert has a ``run`` label, else nothing.
    """
    values.setdefault("of_run", "{{ with $labels.run }} of run {{ . }}{{ end }}")

    def sub(match: re.Match[str]) -> str:
        key = match.group(1)
        if key in values:
            return str(values[key])
        if key.startswith("$"):
            return label(key[1:])
        raise KeyError(f"no value for [[{key}]]")

    return re.sub(r"\[\[(\$?\w+)\]\]", sub, template)


def si_bytes(value: float) -> str:
    """``20000000000`` -> ``20GB`` (decimal units, as disks are sold and the tutorial counts)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}B"


def number(value: float) -> str:
    """A threshold as written in PromQL and prose: ``95`` not ``95.0``."""
    return f"{value:g}"


def with_first(metric: str, match: tuple[str, ...], body: str, extra: str = "",
               otherwise: str | None = None) -> str:
    """Template text rendering ``body`` with the first result of a query, or ``otherwise``.

    :func:`first_sample` of ``metric`` selected by the alert's labels ``match``
    (then ``extra``). With no ``otherwise``, for sentences that only make sense
    when there is something to say ("; last error: …").
    """
    return first_sample(matching(metric, match, extra), template_args(match), body, otherwise)


def indent(text: str, by: int = 2) -> str:
    """``text`` indented, to nest one expression inside another readably."""
    return textwrap.indent(text, " " * by)


def block(vector: str, around: str = "") -> str:
    """``around (`` ``vector`` indented ``)``: an aggregation or function over a
    multi-line vector, or bare parentheses when ``around`` is empty."""
    opening = f"{around} (" if around else "("
    return f"{opening}\n{indent(vector)}\n)"


# A histogram's parts, read so that a rule or panel works whether Prometheus stores it as a
# classic histogram (``x_bucket``/``x_sum``/``x_count`` float series) or converts it at
# scrape into a native histogram with custom buckets (one ``x`` series,
# convert_classic_histograms_to_nhcb, docs/deploy.md): the classic form ``or`` the native
# one. Each side is empty where the other form is stored; where a migration or
# always_scrape_classic_histograms stores both, ``or`` keeps the classic side only, so
# nothing is counted twice.


def histogram_rate(view: Selector, name: str, part: str, window: str) -> str:
    """The per-second rate of histogram ``name``'s ``part`` (``sum`` or ``count``), per
    series, classic or native: ``rate(x_sum[w]) or histogram_sum(rate(x[w]))``."""
    if part not in ("sum", "count"):
        raise ValueError(f"a histogram has no part {part!r} to rate")
    return (f"rate({view(f'{name}_{part}')}[{window}])\n"
            f"or histogram_{part}(rate({view(name)}[{window}]))")


def histogram_quantile(q: float, view: Selector, name: str, by: tuple[str, ...],
                       window: str) -> str:
    """``histogram_quantile`` of histogram ``name`` summed by ``by``, classic or native.

    The native side is kept only ``on`` the groups without classic buckets:
    histogram_quantile evaluates nothing for a group that has both (a naming collision).
    """
    labels = ", ".join(by)
    return (f"histogram_quantile({q:g}, sum by ({labels}, le) (rate({view(name + '_bucket')}"
            f"[{window}])) or on ({labels}) sum by ({labels}) (rate({view(name)}[{window}])))")
