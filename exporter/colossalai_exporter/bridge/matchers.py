"""Label matchers in Alertmanager's syntax: ``a="v"``, ``a!="v"``, ``a=~"re"``, ``a!~"re"``.

Regular expressions are anchored at both ends, as in Prometheus and Alertmanager.
A selector is a list of matchers that must all match; an empty selector
matches every alert. A missing label has the value ``""``, so
``severity!="critical"`` matches an alert without a severity label.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

_MATCHER = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$')
OPS = ("=", "!=", "=~", "!~")


class MatcherError(ValueError):
    pass


# Whether one alert's labels match: a matcher's, or a whole selector's.
Predicate = Callable[[Mapping[str, str]], bool]


@dataclass(frozen=True)
class Matcher:
    name: str
    op: str
    value: str
    # The matcher as one small function, built once: it runs for every target and
    # alert of every notification.
    test: Predicate = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "test", self._compile())

    def _compile(self) -> Predicate:
        name, value = self.name, self.value
        if self.op == "=":
            return lambda labels: labels.get(name, "") == value
        if self.op == "!=":
            return lambda labels: labels.get(name, "") != value
        try:
            fullmatch = re.compile(value).fullmatch
        except re.error as exc:
            raise MatcherError(f"bad regular expression {value!r}: {exc}") from None
        if self.op == "=~":
            return lambda labels: fullmatch(labels.get(name, "")) is not None
        return lambda labels: fullmatch(labels.get(name, "")) is None

    def matches(self, labels: Mapping[str, str]) -> bool:
        return self.test(labels)

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


def compile_selector(selector: Sequence[Matcher]) -> Predicate:
    """The whole selector as one function (all matchers must match; none: everything)."""
    tests = tuple(m.test for m in selector)
    if not tests:
        return lambda labels: True
    if len(tests) == 1:
        return tests[0]

    def all_match(labels: Mapping[str, str]) -> bool:
        # A plain loop: all() over a generator costs a frame per matcher.
        for test in tests:  # noqa: SIM110
            if not test(labels):
                return False
        return True

    return all_match
