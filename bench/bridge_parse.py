"""The bridge's body parser against a one-step typed msgspec decode, interleaved.

``parse_notification`` decodes untyped, then converts into the structs, so that
a number in a key nobody reads is range-checked too (bridge/alertmanager.py).
The peer is what it replaced: ``msgspec.json.Decoder(Notification).decode``,
which skips unknown keys unchecked. Bodies are bench/bridge_ingest.py's
notifications (about 4.4 KB each)::

    .venv/bin/python bench/bridge_parse.py --rounds 9
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).parent))
from bridge_ingest import notification
from colossalai_exporter.bridge.alertmanager import Notification, parse_notification


def per_body_us(parse: Callable[[bytes], object], bodies: list[bytes], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        for body in bodies:
            parse(body)
    return (time.perf_counter() - start) / (repeat * len(bodies)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--bodies", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(1)
    bodies = [json.dumps(notification(i, rng)).encode() for i in range(args.bodies)]
    one_step = msgspec.json.Decoder(Notification).decode
    ours: list[float] = []
    peer: list[float] = []
    for _ in range(args.rounds):  # interleaved: a slow moment hits both
        peer.append(per_body_us(one_step, bodies, args.repeat))
        ours.append(per_body_us(parse_notification, bodies, args.repeat))
    size = sum(map(len, bodies)) / len(bodies)
    print(f"{len(bodies)} bodies of {size:.0f} B on average, {args.rounds} rounds")
    print(f"one-step typed decode: median {statistics.median(peer):.1f} us "
          f"(min {min(peer):.1f})")
    print(f"parse_notification:    median {statistics.median(ours):.1f} us "
          f"(min {min(ours):.1f})")
    ratios = [o / p for o, p in zip(ours, peer, strict=True)]
    print(f"ratio per round: {min(ratios):.2f}-{max(ratios):.2f}, "
          f"median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
