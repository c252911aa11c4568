"""``colossalai-exporter bridge``: run the bridge, check a config, manage the outbox.

    colossalai-exporter bridge --config.file bridge.yml [--web.listen-address :9468]
    colossalai-exporter bridge check --config.file bridge.yml
    colossalai-exporter bridge outbox list|retry|drop --config.file bridge.yml [--dead] [ID…|--all]

``--config`` works as a short form of ``--config.file`` (argparse accepts the
unambiguous prefix).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from colossalai_exporter.bridge.config import DEFAULT_PORT, check_file, load_config
from colossalai_exporter.bridge.store import DeadLetter, Delivery, Store, StoreError
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.flags import ArgumentParser, add_common_flags


def _run(argv: Sequence[str]) -> int:
    parser = ArgumentParser(prog="colossalai-exporter bridge",
                            description="Durable Alertmanager webhook receiver forwarding to "
                                        "Vigilmon heartbeats and webhooks.",
                            epilog="Also: 'colossalai-exporter bridge check --config.file "
                                   "PATH' lists every problem of a config without starting; "
                                   "'colossalai-exporter bridge outbox list|retry|drop' shows "
                                   "and manages undelivered notifications.")
    add_common_flags(parser, DEFAULT_PORT)
    args = parser.parse_args(list(argv))
    if not args.config_file:
        raise ConfigError("--config.file is required (the bridge.yml naming the targets)")
    config = load_config(args.config_file)
    config.daemon.apply_flags(args)
    config.daemon.start_logging()
    web_config = config.daemon.web_config()
    from colossalai_exporter.bridge.runtime import BridgeRuntime

    runtime = BridgeRuntime(config, web_config)
    server = runtime.start(config.daemon.listen_address)
    try:
        server.wait()
    finally:
        runtime.stop()
    return 0


def _check(argv: Sequence[str]) -> int:
    parser = ArgumentParser(prog="colossalai-exporter bridge check",
                            description="Check a bridge config and list every problem (exit 2 "
                                        "if there is one, 0 otherwise); starts nothing.")
    parser.add_argument("--config.file", dest="config_file", required=True, metavar="PATH",
                        help="the bridge config to check")
    args = parser.parse_args(list(argv))
    problems, warnings = check_file(args.config_file)
    for line in [*problems, *warnings]:
        print(line, file=sys.stderr)
    if problems:
        return 2
    print(f"{args.config_file}: ok")
    return 0


def _ids(values: Sequence[str], all_: bool) -> list[int] | None:
    if all_:
        return None
    if not values:
        raise ConfigError("name the delivery ids, or pass --all")
    try:
        return [int(v) for v in values]
    except ValueError:
        raise ConfigError(f"delivery ids are integers, got {' '.join(values)!r}") from None


def _outbox(argv: Sequence[str]) -> int:
    parser = ArgumentParser(prog="colossalai-exporter bridge outbox",
                            description="Show or manage the deliveries not yet made: list "
                                        "them, move dead letters back to the outbox, or drop "
                                        "them. Safe while the bridge runs.")
    parser.add_argument("action", choices=("list", "retry", "drop"),
                        help="list the deliveries, retry dead letters, or drop deliveries")
    parser.add_argument("ids", nargs="*", help="delivery ids (see list)")
    parser.add_argument("--config.file", dest="config_file", required=True, metavar="PATH",
                        help="the bridge's config (its state_dir holds the outbox)")
    parser.add_argument("--dead", action="store_true",
                        help="the dead-letter table instead of the pending outbox "
                             "(retry always moves dead letters back)")
    parser.add_argument("--target", default=None, help="only this target (list)")
    parser.add_argument("--all", dest="all_", action="store_true", help="every delivery")
    args = parser.parse_args(list(argv))
    config = load_config(args.config_file)
    try:
        store = Store(config.state_dir)
    except StoreError as exc:
        raise ConfigError(str(exc)) from None
    try:
        if args.action == "list":
            now = time.time()
            when = "failed_ago" if args.dead else "next_in"
            print(f"{'id':>8}  {'target':<24} {'kind':<8} {'age':>9} {'attempts':>8} "
                  f"{when:>10}  last_error")
            rows: list[Delivery] | list[DeadLetter] = (
                store.dead_letters(args.target) if args.dead else store.pending(args.target))
            for d in rows:
                timing = now - d.failed_at if isinstance(d, DeadLetter) \
                    else d.next_attempt_at - now
                print(f"{d.id:>8}  {d.target:<24} {d.kind:<8} {now - d.created_at:>8.0f}s "
                      f"{d.attempts:>8} {max(0.0, timing):>9.0f}s  {d.last_error}")
            return 0
        ids = _ids(args.ids, args.all_)
        if args.action == "retry":
            print(f"moved {store.retry_dead(ids)} dead letter(s) back to the outbox")
        else:
            table = "dead letter(s)" if args.dead else "pending deliveries"
            print(f"dropped {store.drop_ids(ids, dead=args.dead)} {table}")
        return 0
    except StoreError as exc:
        raise ConfigError(f"state database {store.path}: {exc}") from None
    finally:
        store.close()


def main(argv: list[str]) -> int:
    """Entry point of ``colossalai-exporter bridge``."""
    if argv and argv[0] == "check":
        return _check(argv[1:])
    if argv and argv[0] == "outbox":
        return _outbox(argv[1:])
    return _run(argv)
