"""The durable outbox: SQLite in WAL mode with ``synchronous=FULL`` in the state directory.

Why SQLite: one file, transactions, crash safety that is tested by its
authors far beyond anything hand-written, and it ships with Python. WAL lets
the CLI (``bridge outbox list``) read while the bridge writes; ``synchronous=
FULL`` makes every commit fsync the WAL, so a notification acknowledged with
200 survives a kill -9 or a power cut.

Tables:

* ``notifications``: every accepted body, as received.
* ``outbox``: one row per pending delivery (target, kind ``ping``/``fail``/
  ``webhook``), delivered oldest first per target. AUTOINCREMENT because ids
  must never be reused: a worker finishing a superseded delivery deletes by id,
  and a recycled id would delete the newer delivery unsent.
* ``dead_letters``: deliveries given up on (``bridge outbox retry`` moves them back).
* ``dedup_log``: per target, keys of notifications already queued, with when, in
  the order they were stored. Looked up in memory (:class:`DedupIndex`, loaded on
  first use); the table only makes the keys survive a restart. An index on the
  keys, as before, cost the commit more than everything else together: each
  key is a hash, so each insert landed on a different page of the index, and
  every such page went to the WAL and its fsync (bench/RESULTS.md).
* ``firing``: per health-heartbeat target, the matching alerts currently firing.
* ``target_state``: per target, when it last succeeded.

All access goes through one connection guarded by a lock: writes are
serialised by SQLite anyway, and the lock keeps Python's sqlite3 module safe
across the threads that use it: the group committer's and the delivery workers'.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

SCHEMA = """
CREATE TABLE IF NOT EXISTS notifications (
    id INTEGER PRIMARY KEY, received_at REAL NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT, target TEXT NOT NULL, kind TEXT NOT NULL,
    notification_id INTEGER NOT NULL, created_at REAL NOT NULL,
    next_attempt_at REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS outbox_by_target ON outbox (target, id);
CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY, target TEXT NOT NULL, kind TEXT NOT NULL,
    notification_id INTEGER NOT NULL, created_at REAL NOT NULL, failed_at REAL NOT NULL,
    attempts INTEGER NOT NULL, last_error TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS dedup_log (
    id INTEGER PRIMARY KEY, target TEXT NOT NULL, key TEXT NOT NULL, seen_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS firing (
    target TEXT NOT NULL, fingerprint TEXT NOT NULL, labels TEXT NOT NULL,
    last_seen REAL NOT NULL, PRIMARY KEY (target, fingerprint));
CREATE TABLE IF NOT EXISTS target_state (
    target TEXT PRIMARY KEY, last_success REAL, last_attempt REAL);
"""
DB_NAME = "bridge.sqlite3"


class StoreError(Exception):
    """The store cannot take the write (disk full, read-only, I/O error)."""


@dataclass(frozen=True)
class Enqueue:
    """Queue a delivery of the notification to ``target``."""

    target: str
    kind: str  # ping | fail | webhook
    dedup_key: str | None = None  # webhooks: skip if seen within dedup_window
    dedup_window: float = 0.0
    newest_only: bool = False  # heartbeats: drop older pending pings of the target


@dataclass(frozen=True)
class FiringUpdate:
    """A health-heartbeat target saw an alert firing (or resolved)."""

    target: str
    fingerprint: str
    labels: str
    firing: bool


@dataclass(frozen=True)
class IngestItem:
    """One accepted notification as :meth:`Store.ingest_many` stores it."""

    body: bytes
    enqueues: tuple[Enqueue, ...]
    firing: tuple[FiringUpdate, ...]
    now: float


@dataclass(frozen=True)
class IngestResult:
    notification_id: int
    queued: tuple[str, ...]
    deduplicated: tuple[str, ...]
    superseded: dict[str, int]


@dataclass(frozen=True)
class Delivery:
    id: int
    target: str
    kind: str
    notification_id: int
    created_at: float
    next_attempt_at: float
    attempts: int
    last_error: str


@dataclass(frozen=True)
class DeadLetter:
    """A delivery given up on: when it failed for the last time, and why."""

    id: int
    target: str
    kind: str
    notification_id: int
    created_at: float
    failed_at: float
    attempts: int
    last_error: str


@dataclass(frozen=True)
class QueueStats:
    depth: int
    oldest_created_at: float | None


class Store:
    """The bridge's SQLite database in ``state_dir``; created on first open."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / DB_NAME
        self._clock = time.time
        self._lock = threading.RLock()
        self._dedup_index: DedupIndex | None = None
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None,
                                       check_same_thread=False, timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            # Keep the WAL from growing without bound between checkpoints.
            self._db.execute("PRAGMA journal_size_limit=4194304")
            self._db.executescript(SCHEMA)
            self._migrate()
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the state database {self.path}: {exc}") from None

    def _migrate(self) -> None:
        """Databases from before the dedup log kept their keys in an indexed table."""
        old = self._db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND "
                               "name='dedup'").fetchone()
        if old is None:
            return
        with self._transaction() as db:
            db.execute("INSERT INTO dedup_log (target, key, seen_at) "
                       "SELECT target, key, seen_at FROM dedup ORDER BY seen_at")
            db.execute("DROP TABLE dedup")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _dedup(self) -> DedupIndex:
        """The dedup keys in memory, read from the log on first use (the CLI never needs them)."""
        if self._dedup_index is None:
            rows = self._db.execute("SELECT target, key, seen_at FROM dedup_log ORDER BY id")
            self._dedup_index = DedupIndex((str(t), str(k), float(at)) for t, k, at in rows)
        return self._dedup_index

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
            except (sqlite3.Error, OSError) as exc:
                raise StoreError(str(exc)) from exc

    # -- ingest -------------------------------------------------------------------------

    def ingest(self, body: bytes, enqueues: Sequence[Enqueue],
               firing: Sequence[FiringUpdate] = (), now: float | None = None) -> IngestResult:
        """Store a notification and its deliveries in one committed transaction."""
        now = self._clock() if now is None else now
        (result,) = self.ingest_many([IngestItem(body, tuple(enqueues), tuple(firing), now)])
        if isinstance(result, StoreError):
            raise result
        return result

    def ingest_many(self, items: Sequence[IngestItem]) -> list[IngestResult | StoreError]:
        """Store several notifications in one transaction: one commit, one fsync for all.

        This is the group commit behind the HTTP route: requests that arrive while a
        commit is being synced wait for the next one together, so the cost of the
        fsync is shared. Items are applied in order, so ids (and delivery order)
        follow arrival, and a later item is deduplicated against an earlier one of
        the same batch. If the batch fails, each item is retried in its own
        transaction, so one item that cannot be stored (too large for the disk
        that is left) does not refuse the others; each result is an
        :class:`IngestResult` or the :class:`StoreError` for that item.
        """
        if not items:
            return []
        with self._lock:
            try:
                return self._commit(items)
            except StoreError as exc:
                if len(items) == 1:
                    return [exc]
            results: list[IngestResult | StoreError] = []
            for item in items:
                try:
                    results.extend(self._commit([item]))
                except StoreError as exc:
                    results.append(exc)
            return results

    def _commit(self, items: Sequence[IngestItem]) -> list[IngestResult | StoreError]:
        dedup = self._dedup()
        with self._transaction() as db:
            results, seen = self._ingest_batch(db, dedup, items)
        dedup.add(seen)  # only once committed: a rollback leaves no trace
        return results

    @staticmethod
    def _ingest_batch(db: sqlite3.Connection, dedup: DedupIndex, items: Sequence[IngestItem],
                      ) -> tuple[list[IngestResult | StoreError], list[DedupRow]]:
        """Apply ``items`` in order, in a few statements whatever their number.

        The one ingest path, for one notification or many. Why not one statement per
        row: every statement releases the GIL and must win it back from the event
        loop thread, which is busy parsing the next requests; a few dozen hand-overs
        per batch made the commit cycle, not the disk, the limit (bench/RESULTS.md,
        the bridge's ingest figures). Here a batch costs one multi-row statement per
        table (dedup keys are looked up in memory). The effect is the same as
        storing the items one after another (a unit test compares the two): ids
        follow the items' order, an item is deduplicated against earlier items of
        the batch, a newer ping supersedes an older one of the same batch.
        """
        first_id = int(db.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM notifications")
                       .fetchone()[0])
        batch = _Batch(first_id, dedup)
        for item in items:
            batch.add(item)
        # Rows queued before this batch are superseded by its first ping to the target.
        for target, first in sorted(batch.first_ping.items()):
            dropped = db.execute("DELETE FROM outbox WHERE target=?", (target,)).rowcount
            if dropped:
                counts = batch.superseded[first]
                counts[target] = counts.get(target, 0) + dropped
        _insert(db, "INSERT INTO notifications (id, received_at, body)", batch.notifications)
        _insert(db, "INSERT INTO dedup_log (target, key, seen_at)", batch.dedup)
        _insert(db, "INSERT INTO outbox (target, kind, notification_id, created_at, "
                "next_attempt_at)", [row for row in batch.outbox if row is not None])
        _insert(db, "INSERT OR REPLACE INTO firing (target, fingerprint, labels, last_seen)",
                [(u.target, u.fingerprint, u.labels, at)
                 for u, at in batch.firing.values() if u.firing])
        for u, _ in batch.firing.values():
            if not u.firing:  # resolves are rare: one statement each is fine
                db.execute("DELETE FROM firing WHERE target=? AND fingerprint=?",
                           (u.target, u.fingerprint))
        return [IngestResult(first_id + i, queued, deduplicated, batch.superseded[i])
                for i, (queued, deduplicated) in enumerate(batch.outcomes)], batch.dedup

    # -- delivery -----------------------------------------------------------------------

    def resume(self, now: float | None = None) -> int:
        """On start, make every pending delivery due now: a restart is often the fix."""
        now = self._clock() if now is None else now
        with self._transaction() as db:
            return int(db.execute("UPDATE outbox SET next_attempt_at=? WHERE next_attempt_at > ?",
                                  (now, now)).rowcount)

    def next_delivery(self, target: str) -> Delivery | None:
        """The oldest pending delivery of ``target`` (deliveries go out in arrival order)."""
        with self._lock:
            row = self._db.execute(
                "SELECT id, target, kind, notification_id, created_at, next_attempt_at, "
                "attempts, last_error FROM outbox WHERE target=? ORDER BY id LIMIT 1",
                (target,)).fetchone()
        return Delivery(*row) if row else None

    def notification_body(self, notification_id: int) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM notifications WHERE id=?",
                                   (notification_id,)).fetchone()
        return bytes(row[0]) if row else None

    def delivered(self, delivery: Delivery, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        with self._transaction() as db:
            db.execute("DELETE FROM outbox WHERE id=?", (delivery.id,))
            db.execute("INSERT INTO target_state (target, last_success, last_attempt) "
                       "VALUES (?, ?, ?) ON CONFLICT(target) DO UPDATE SET "
                       "last_success=excluded.last_success, last_attempt=excluded.last_attempt",
                       (delivery.target, now, now))

    def failed(self, delivery: Delivery, error: str, retry_at: float,
               now: float | None = None) -> None:
        now = self._clock() if now is None else now
        with self._transaction() as db:
            db.execute("UPDATE outbox SET attempts=attempts+1, next_attempt_at=?, last_error=? "
                       "WHERE id=?", (retry_at, error, delivery.id))
            self._attempted(db, delivery.target, now)

    def dead_letter(self, delivery: Delivery, error: str, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM outbox WHERE id=?", (delivery.id,)).rowcount
            if deleted:
                db.execute("INSERT INTO dead_letters (id, target, kind, notification_id, "
                           "created_at, failed_at, attempts, last_error) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                           (delivery.id, delivery.target, delivery.kind,
                            delivery.notification_id, delivery.created_at, now,
                            delivery.attempts + 1, error))
            self._attempted(db, delivery.target, now)

    def drop(self, delivery: Delivery) -> None:
        """Forget a delivery that must not be sent late (an expired heartbeat ping)."""
        with self._transaction() as db:
            db.execute("DELETE FROM outbox WHERE id=?", (delivery.id,))

    @staticmethod
    def _attempted(db: sqlite3.Connection, target: str, now: float) -> None:
        db.execute("INSERT INTO target_state (target, last_attempt) VALUES (?, ?) "
                   "ON CONFLICT(target) DO UPDATE SET last_attempt=excluded.last_attempt",
                   (target, now))

    def record_success(self, target: str, now: float | None = None) -> None:
        """A success outside the outbox (a scheduled health-heartbeat ping)."""
        now = self._clock() if now is None else now
        with self._transaction() as db:
            db.execute("INSERT INTO target_state (target, last_success, last_attempt) "
                       "VALUES (?, ?, ?) ON CONFLICT(target) DO UPDATE SET "
                       "last_success=excluded.last_success, last_attempt=excluded.last_attempt",
                       (target, now, now))

    def record_attempt(self, target: str, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        with self._transaction() as db:
            self._attempted(db, target, now)

    # -- health-heartbeat state ---------------------------------------------------------

    def firing(self, target: str, now: float | None = None,
               alert_ttl: float | None = None) -> list[tuple[str, str, float]]:
        """(fingerprint, labels JSON, last seen) of alerts firing for ``target``.

        With ``alert_ttl``, alerts not re-notified within it are first forgotten:
        Alertmanager re-sends firing alerts every repeat_interval, so one that
        stops coming has ended even if its resolve was never delivered.
        """
        now = self._clock() if now is None else now
        if alert_ttl is not None:
            with self._transaction() as db:
                db.execute("DELETE FROM firing WHERE target=? AND last_seen < ?",
                           (target, now - alert_ttl))
        with self._lock:
            rows = self._db.execute("SELECT fingerprint, labels, last_seen FROM firing "
                                    "WHERE target=? ORDER BY fingerprint", (target,)).fetchall()
        return [(str(a), str(b), float(c)) for a, b, c in rows]

    # -- metrics and the CLI ------------------------------------------------------------

    def queue_stats(self) -> dict[str, QueueStats]:
        with self._lock:
            rows = self._db.execute("SELECT target, COUNT(*), MIN(created_at) FROM outbox "
                                    "GROUP BY target").fetchall()
        return {str(t): QueueStats(int(n), float(o) if o is not None else None)
                for t, n, o in rows}

    def dead_letter_counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT target, COUNT(*) FROM dead_letters "
                                    "GROUP BY target").fetchall()
        return {str(t): int(n) for t, n in rows}

    def last_successes(self) -> dict[str, float]:
        with self._lock:
            rows = self._db.execute("SELECT target, last_success FROM target_state "
                                    "WHERE last_success IS NOT NULL").fetchall()
        return {str(t): float(s) for t, s in rows}

    def pending(self, target: str | None = None) -> list[Delivery]:
        """The outbox (one target's, or all), oldest first."""
        return [Delivery(*row) for row in self._rows(
            "outbox", "next_attempt_at", target)]

    def dead_letters(self, target: str | None = None) -> list[DeadLetter]:
        """The dead letters (one target's, or all), oldest first."""
        return [DeadLetter(*row) for row in self._rows("dead_letters", "failed_at", target)]

    def _rows(self, table: str, when: str, target: str | None) -> list[Any]:
        where, args = ("WHERE target=?", (target,)) if target else ("", ())
        with self._lock:
            rows: list[Any] = self._db.execute(
                f"SELECT id, target, kind, notification_id, created_at, {when}, attempts, "
                f"last_error FROM {table} {where} ORDER BY id", args).fetchall()
        return rows

    def retry_dead(self, ids: Sequence[int] | None, now: float | None = None) -> int:
        """Move dead letters (all when ``ids`` is None) back into the outbox."""
        now = self._clock() if now is None else now
        with self._transaction() as db:
            rows = db.execute("SELECT id, target, kind, notification_id FROM dead_letters "
                              "ORDER BY id").fetchall()
            moved = 0
            for row in rows:
                if ids is not None and row[0] not in ids:
                    continue
                db.execute("INSERT INTO outbox (target, kind, notification_id, created_at, "
                           "next_attempt_at) VALUES (?, ?, ?, ?, ?)",
                           (row[1], row[2], row[3], now, now))
                db.execute("DELETE FROM dead_letters WHERE id=?", (row[0],))
                moved += 1
        return moved

    def drop_ids(self, ids: Sequence[int] | None, dead: bool) -> int:
        table = "dead_letters" if dead else "outbox"
        with self._transaction() as db:
            if ids is None:
                return int(db.execute(f"DELETE FROM {table}").rowcount)
            return sum(int(db.execute(f"DELETE FROM {table} WHERE id=?", (i,)).rowcount)
                       for i in ids)

    def prune(self, dedup_older_than: float, now: float | None = None) -> None:
        """Forget old dedup keys and notifications no delivery refers to any more."""
        now = self._clock() if now is None else now
        # Under the lock throughout: the writer thread adds keys to the index.
        with self._lock:
            with self._transaction() as db:
                # A scan, with no index on seen_at: the table holds one window's keys,
                # and this runs once a minute, where an index would cost every commit.
                db.execute("DELETE FROM dedup_log WHERE seen_at < ?",
                           (now - dedup_older_than,))
                db.execute("DELETE FROM notifications WHERE received_at < ? AND id NOT IN "
                           "(SELECT notification_id FROM outbox) AND id NOT IN "
                           "(SELECT notification_id FROM dead_letters)", (now - 3600.0,))
            if self._dedup_index is not None:
                self._dedup_index.forget_before(now - dedup_older_than)

    def writable(self) -> tuple[bool, str]:
        """Whether a new notification could be stored now: a synced probe write and a commit.

        The probe file catches a full disk that SQLite would only notice once its WAL
        must grow; the commit catches a database that became read-only or corrupt.
        """
        probe = self.state_dir / ".write-probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
            with self._transaction() as db:
                db.execute("INSERT INTO target_state (target) VALUES ('') "
                           "ON CONFLICT(target) DO NOTHING")
        except (OSError, StoreError) as exc:
            return False, str(exc)
        return True, ""


DedupRow = tuple[str, str, float]  # target, key, seen at


class DedupIndex:
    """Per (target, key), when a notification with that dedup key was last stored.

    Memory grows with the keys inside the dedup window: at the 0.1-1 notification/s
    of a busy Alertmanager, a 4 h window holds 1,500-15,000 keys per target,
    about 200 bytes each. Guarded by the store's lock.
    """

    def __init__(self, rows: Iterable[DedupRow] = ()) -> None:
        self._seen: dict[tuple[str, str], float] = {}
        self.add(rows)

    def seen_at(self, target: str, key: str) -> float | None:
        return self._seen.get((target, key))

    def add(self, rows: Iterable[DedupRow]) -> None:
        """Record stored keys; a later row of the same key replaces an earlier one."""
        for target, key, at in rows:
            self._seen[target, key] = at

    def forget_before(self, cutoff: float) -> None:
        self._seen = {pair: at for pair, at in self._seen.items() if at >= cutoff}


class _Batch:
    """The rows a batch writes, worked out in Python in the items' order."""

    def __init__(self, first_id: int, stored: DedupIndex) -> None:
        self.first_id = first_id
        self.stored = stored  # dedup keys already stored
        self.seen: dict[tuple[str, str], float] = {}  # those of this batch
        self.dedup: list[DedupRow] = []  # rows for the log, in order
        self.notifications: list[tuple[object, ...]] = []
        self.outbox: list[tuple[object, ...] | None] = []  # None: superseded in the batch
        self.newest: dict[str, int] = {}  # heartbeat target -> its ping's index in outbox
        self.first_ping: dict[str, int] = {}  # heartbeat target -> item of its first ping
        self.firing: dict[tuple[str, str], tuple[FiringUpdate, float]] = {}  # last one wins
        self.outcomes: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        self.superseded: list[dict[str, int]] = []

    def add(self, item: IngestItem) -> None:
        index = len(self.notifications)
        notification_id = self.first_id + index
        now = item.now
        self.notifications.append((notification_id, now, item.body))
        queued: list[str] = []
        deduplicated: list[str] = []
        superseded: dict[str, int] = {}
        for enqueue in item.enqueues:
            if enqueue.dedup_key is not None:
                pair = (enqueue.target, enqueue.dedup_key)
                seen_at = self.seen.get(pair)
                if seen_at is None:
                    seen_at = self.stored.seen_at(*pair)
                if seen_at is not None and now - seen_at < enqueue.dedup_window:
                    deduplicated.append(enqueue.target)
                    continue
                self.seen[pair] = now
                self.dedup.append((enqueue.target, enqueue.dedup_key, now))
            if enqueue.newest_only:
                earlier = self.newest.get(enqueue.target)
                if earlier is not None:
                    self.outbox[earlier] = None
                    superseded[enqueue.target] = 1
                else:
                    self.first_ping[enqueue.target] = index
                self.newest[enqueue.target] = len(self.outbox)
            self.outbox.append((enqueue.target, enqueue.kind, notification_id, now, now))
            queued.append(enqueue.target)
        for update in item.firing:
            self.firing[update.target, update.fingerprint] = (update, now)
        self.outcomes.append((tuple(queued), tuple(deduplicated)))
        self.superseded.append(superseded)


# SQLite before 3.32 allows at most 999 parameters in one statement.
_MAX_PARAMETERS = 999
_Row = TypeVar("_Row")


def _chunks(rows: Sequence[_Row], width: int) -> Iterator[Sequence[_Row]]:
    step = max(1, _MAX_PARAMETERS // width)
    for start in range(0, len(rows), step):
        yield rows[start:start + step]


def _placeholders(rows: int, width: int) -> str:
    one = "(" + ", ".join("?" * width) + ")"
    return ", ".join([one] * rows)


def _insert(db: sqlite3.Connection, head: str, rows: Sequence[tuple[object, ...]]) -> None:
    """One multi-row INSERT per chunk: one statement, one GIL hand-over, for many rows."""
    if not rows:
        return
    width = len(rows[0])
    for chunk in _chunks(rows, width):
        db.execute(f"{head} VALUES {_placeholders(len(chunk), width)}",
                   [v for row in chunk for v in row])
