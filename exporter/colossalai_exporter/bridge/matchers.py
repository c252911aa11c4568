"""Label matchers in Alertmanager's syntax: ``a="v"``, ``a!="v"``, ``a=~"re"``, ``a!~"re"``.

Regular expressions are anchored at both ends, as in Prometheus and Alertmanager.
A selector is a list of matchers that must all match; an empty selector
matches every alert. A missing label has the value ``""``, so
``severity!="critical"`` matches an alert without a severity label.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_MATCHER = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$')
OPS = ("=", "!=", "=~", "!~")


class MatcherError(ValueError):
    pass


@dataclass(frozen=True)
class Matcher:
    name: str
    op: str
    value: str

    def __post_init__(self) -> None:
        if self.op in ("=~", "!~"):
            try:
                object.__setattr__(self, "_regex", re.compile(self.value))
            except re.error as exc:
                raise MatcherError(f"bad regular expression {self.value!r}: {exc}") from None

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.name, "")
        if self.op == "=":
            return value == self.value
        if self.op == "!=":
            return value != self.value
        regex: re.Pattern[str] = getattr(self, "_regex")  # noqa: B009 - set in __post_init__
        hit = regex.fullmatch(value) is not None
        return hit if self.op == "=~" else not hit

    def __str__(self) -> str:
        return f"{self.name}{self.op}{json.dumps(self.value)}"


def parse_matcher(text: str) -> Matcher:
    """``'alertname="Watchdog"'`` -> Matcher; quotes around the value are optional."""
    found = _MATCHER.match(text)
    if not found:
        raise MatcherError(f"{text!r} is not a matcher like name=\"value\" (operators: "
                           f"{', '.join(OPS)})")
    name, op, raw = found.groups()
    if raw.startswith('"'):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise MatcherError(f"{text!r}: the quoted value is not closed or not valid") \
                from None
        if not isinstance(value, str):
            raise MatcherError(f"{text!r}: the value must be a string")
    else:
        value = raw
    return Matcher(name, op, value)


def parse_selector(items: Sequence[str]) -> tuple[Matcher, ...]:
    return tuple(parse_matcher(item) for item in items)


def selector_matches(selector: Sequence[Matcher], labels: Mapping[str, str]) -> bool:
    # A plain loop: this runs for every target and alert of every notification, and
    # all() over a generator costs a frame per matcher.
    for matcher in selector:  # noqa: SIM110 - all() over a generator is slower here
        if not matcher.matches(labels):
            return False
    return True
