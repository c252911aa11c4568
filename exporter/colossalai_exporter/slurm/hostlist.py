"""Slurm hostlist expressions expanded to host names, without ``scontrol``.

``scontrol show hostnames "$SLURM_JOB_NODELIST"`` does the same, but it needs
the Slurm client tools and a reachable slurmctld config, which the machine
writing Prometheus targets (or a container) may not have.

Supported, as Slurm writes them:

* host names separated by commas: ``login1,login2``;
* a bracket group of numbers and ranges: ``node[01-04,07]``; zero padding is
  kept, its width taken from the range's first number (``node[08-10]`` gives
  ``node08 node09 node10``, ``node[8-10]`` gives ``node8 node9 node10``);
* text after a group: ``gpu[1-2]-ib``;
* several groups in one name, expanded left to right (the cartesian product):
  ``rack[1-2]-node[01-02]`` gives ``rack1-node01 rack1-node02 rack2-node01
  rack2-node02``;
* groups and plain names mixed: ``gpu-a[1-2],gpu-b3``.

A name listed twice appears once, where it first appears. Not supported (an
error): nested brackets, a range that counts down, ``*`` or ``^`` wildcards
and steps, spaces, empty names. Anything else is a :class:`HostlistError`
with one line naming the position.
"""

from __future__ import annotations

import itertools
import re

#: a bound on the expansion: a typo like ``n[0-99999999]`` must not eat memory
MAX_HOSTS = 65536

_NAME_CHARS = re.compile(r"[A-Za-z0-9._-]+")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(ValueError):
    """A hostlist expression that does not parse; the message is one line."""


def _expand_group(body: str, expression: str, start: int) -> list[str]:
    """``01-04,07`` (the text inside one bracket pair) to ``['01', …, '07']``."""
    if not body:
        raise HostlistError(f"{expression!r}: empty brackets at position {start}")
    values: list[str] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise HostlistError(f"{expression!r}: {part!r} in brackets at position {start} "
                                "is not a number or a range like 01-04")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise HostlistError(f"{expression!r}: range {part!r} at position {start} "
                                "counts down")
        if int(high) - int(low) >= MAX_HOSTS:
            raise HostlistError(f"{expression!r}: range {part!r} expands to more than "
                                f"{MAX_HOSTS} hosts")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def _split_top_level(expression: str) -> list[tuple[int, str]]:
    """Split on the commas outside brackets: ``(position, item)`` pairs."""
    items: list[tuple[int, str]] = []
    depth = 0
    begin = 0
    for i, char in enumerate(expression):
        if char == "[":
            if depth:
                raise HostlistError(f"{expression!r}: nested '[' at position {i}")
            depth = 1
        elif char == "]":
            if not depth:
                raise HostlistError(f"{expression!r}: ']' without '[' at position {i}")
            depth = 0
        elif char == "," and not depth:
            items.append((begin, expression[begin:i]))
            begin = i + 1
    if depth:
        raise HostlistError(f"{expression!r}: '[' at position "
                            f"{expression.rindex('[')} is never closed")
    items.append((begin, expression[begin:]))
    return items


def _expand_item(item: str, offset: int, expression: str) -> list[str]:
    """One comma-free item (``rack[1-2]-node[01-02]``) to its host names."""
    if not item:
        raise HostlistError(f"{expression!r}: empty host name at position {offset}")
    # Alternating pieces: text, group body, text, group body, …, text.
    pieces = re.split(r"\[([^\]]*)\]", item)
    choices: list[list[str]] = []
    position = offset
    for index, piece in enumerate(pieces):
        if index % 2:  # a bracket group's body
            choices.append(_expand_group(piece, expression, position))
            position += len(piece) + 2
            continue
        if piece and not _NAME_CHARS.fullmatch(piece):
            bad = next(c for c in piece if not _NAME_CHARS.fullmatch(c))
            raise HostlistError(f"{expression!r}: character {bad!r} at position "
                                f"{position + piece.index(bad)} cannot be in a host name")
        choices.append([piece])
        position += len(piece)
    total = 1
    for options in choices:
        total *= len(options)
    if total > MAX_HOSTS:
        raise HostlistError(f"{expression!r}: expands to more than {MAX_HOSTS} hosts")
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand(expression: str) -> list[str]:
    """Host names of a Slurm hostlist expression, in order, each once."""
    text = expression.strip()
    if not text:
        raise HostlistError("the nodelist is empty")
    hosts: dict[str, None] = {}  # an ordered set
    for offset, item in _split_top_level(text):
        for host in _expand_item(item, offset, text):
            hosts.setdefault(host, None)
        if len(hosts) > MAX_HOSTS:
            raise HostlistError(f"{text!r}: expands to more than {MAX_HOSTS} hosts")
    return list(hosts)
