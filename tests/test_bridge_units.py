"""The bridge's pure parts: payload parser, matchers, routing and dedup keys, config
validation, signing, backoff, and the store's transactions on a real SQLite file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bridge_payloads import alert, body, notification
from colossalai_exporter.bridge import signing
from colossalai_exporter.bridge.alertmanager import PayloadError, parse_notification
from colossalai_exporter.bridge.config import RetryPolicy, validate
from colossalai_exporter.bridge.ingest import dedup_key, plan
from colossalai_exporter.bridge.matchers import MatcherError, parse_matcher
from colossalai_exporter.bridge.sender import parse_retry_after
from colossalai_exporter.bridge.store import Enqueue, FiringUpdate, IngestItem, Store, StoreError
from colossalai_exporter.bridge.workers import backoff_delay


def test_parses_an_alertmanager_body() -> None:
    n = parse_notification(body(alert(job="llama"), alert("TrainingStalled", job="llama")))
    assert n.version == "4"
    assert n.status == "firing"
    assert n.receiver == "colossalai\\.bridge"
    assert [a.labels["alertname"] for a in n.alerts] == ["Watchdog", "TrainingStalled"]
    assert n.alerts[0].ends_at == "0001-01-01T00:00:00Z"
    assert len(n.alerts[0].fingerprint) == 16


def test_newer_fields_are_accepted() -> None:
    data = notification()
    data["notification_reason"] = "repeat"
    data["routeLabels"] = {"team": "ml"}
    parsed = parse_notification(json.dumps(data).encode())
    assert parsed == parse_notification(json.dumps(notification()).encode())


def _mutate(change: dict[str, object], drop: tuple[str, ...] = ()) -> bytes:
    data = notification()
    data.update(change)
    for key in drop:
        data.pop(key)
    return json.dumps(data).encode()


@pytest.mark.parametrize(("raw", "reason", "words"), [
    (b"\xff\xfe{}", "invalid_utf8", "UTF-8"),
    (b'{"version": "4",', "malformed_json", "not JSON"),
    (b"[]", "invalid_type", "JSON object"),
    (_mutate({"version": "3"}), "unknown_version", "'3'"),
    (_mutate({"version": 4}), "invalid_type", "version must be a string"),
    (_mutate({}, drop=("version",)), "missing_field", "version is required"),
    (_mutate({}, drop=("status",)), "missing_field", "status is required"),
    (_mutate({}, drop=("groupKey",)), "missing_field", "groupKey is required"),
    (_mutate({"alerts": "x"}), "invalid_type", "alerts must be an array"),
    (_mutate({"status": "burning"}), "invalid_value", "firing or resolved"),
    (_mutate({"alerts": [{"status": "firing", "labels": {"a": 1}, "startsAt": "t"}]}),
     "invalid_type", "alerts[0].labels values must be a string, got int"),
    (_mutate({"alerts": [{"status": "firing", "startsAt": "t"}]}),
     "missing_field", "alerts[0].labels is required"),
    (_mutate({"truncatedAlerts": -1}), "invalid_value", "truncatedAlerts"),
    (_mutate({"truncatedAlerts": 10**30}), "invalid_value", "truncatedAlerts"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "malformed_json", "nested too deeply"),
    (b"[" * 100_000, "malformed_json", "nested too deeply"),
    # Strict JSON: the body is stored and forwarded as received.
    (_mutate({})[:-1] + b', "x": NaN}', "malformed_json", "invalid character"),
    (_mutate({})[:-1] + b', "x": -Infinity}', "malformed_json", "invalid character"),
    (_mutate({})[:-1] + b', "x": ' + b"9" * 5000 + b"}", "invalid_value", "out of range"),
    (_mutate({})[:-1] + b', "x": [1e999]}', "invalid_value", "out of range"),
    (_mutate({})[:-1] + b', "x": {"y": -1E+400}}', "invalid_value", "out of range"),
    (_mutate({"receiver": "a \ud800"}),  # json.dumps writes the lone \ud800 escape
     "malformed_json", "surrogate"),
    (b'{"version": "4", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "malformed_json", "nested too deeply"),
])
def test_bad_payloads_name_the_problem(raw: bytes, reason: str, words: str) -> None:
    with pytest.raises(PayloadError) as caught:
        parse_notification(raw)
    assert caught.value.reason == reason
    assert words in caught.value.message


def test_matchers() -> None:
    labels = {"alertname": "TrainingStalled", "job": "llama-7b"}
    assert parse_matcher('alertname="TrainingStalled"').matches(labels)
    assert parse_matcher("job=~llama-.*").matches(labels)
    assert not parse_matcher('job=~"llama"').matches(labels)  # anchored
    assert parse_matcher('severity!="critical"').matches(labels)  # missing label is ""
    assert parse_matcher('job!~"gpt.*"').matches(labels)
    with pytest.raises(MatcherError, match="not a matcher"):
        parse_matcher("job")
    with pytest.raises(MatcherError, match="bad regular expression"):
        parse_matcher('job=~"("')


def _config(targets: list[dict[str, object]], **extra: object) -> dict[str, object]:
    return {"state_dir": "/tmp/x", "targets": targets, **extra}


def test_routing_heartbeats_health_and_webhooks() -> None:
    config, problems = validate(_config([
        {"name": "wd", "type": "heartbeat", "url": "http://v/api/heartbeat/t",
         "fail": {"url": "http://v/fail"}},
        {"name": "hh", "type": "health_heartbeat", "url": "http://v/h",
         "selector": ['alertname="TrainingStalled"', 'job="llama"']},
        {"name": "crit", "type": "webhook", "url": "http://hooks/x",
         "selector": ['severity="critical"']},
    ]))
    assert problems == []
    assert config is not None
    n = parse_notification(body(alert(), alert("TrainingStalled", job="llama",
                                               severity="critical")))
    enqueues, updates = plan(n, config.targets)
    assert [(e.target, e.kind, e.newest_only, e.dedup_key is not None) for e in enqueues] == [
        ("wd", "ping", True, False), ("crit", "webhook", False, True)]
    assert [(u.target, u.firing) for u in updates] == [("hh", True)]
    resolved = parse_notification(body(alert(status="resolved")))
    assert [(e.target, e.kind) for e in plan(resolved, config.targets)[0]] == [("wd", "fail")]


def test_dedup_key_ignores_sender_but_not_content() -> None:
    a = parse_notification(body(alert(job="x"), receiver="one"))
    b = parse_notification(body(alert(job="x"), receiver="two"))  # the other HA replica
    refired = parse_notification(body(alert(job="x", starts_at="2024-05-02T00:00:00Z")))
    resolved = parse_notification(body(alert(job="x", status="resolved")))
    assert dedup_key(a) == dedup_key(b)
    assert len({dedup_key(a), dedup_key(refired), dedup_key(resolved)}) == 3


def test_config_problems_are_all_reported_one_per_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE_URL", raising=False)
    config, problems = validate({
        "targets": [
            {"name": "a b", "type": "heartbeat", "url": "http://x/"},
            {"name": "w", "type": "webhook", "url_env": "NOPE_URL"},
            {"name": "h", "type": "health_heartbeat", "url": "ftp://secret-token@x/",
             "interval": "1m", "alert_ttl": "30s", "selector": ["bad"]},
            {"name": "t", "type": "teapot"},
            {"name": "z", "type": "heartbeat", "url": "http://x/", "timeout": "soon",
             "surprise": 1},
        ],
        "receiver": {"bearer_token": "a", "bearer_token_file": "/b"},
    })
    assert config is None
    text = "\n".join(problems)
    for expected in ("state_dir: is required", "targets[0].name: is required",
                     "environment variable NOPE_URL is not set",
                     "url must be an absolute http:// or https:// URL",
                     "alert_ttl: must be longer than interval", "is not a matcher",
                     "targets[t].type: invalid value 'teapot' (one of: heartbeat, "
                     "health_heartbeat, webhook)",
                     "'soon' is not a duration",
                     "unknown key `surprise`", "give only one of bearer_token"):
        assert expected in text, expected
    assert "secret-token" not in text  # a URL's token never appears in an error
    assert all("\n" not in p for p in problems)


def test_secrets_from_files_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "url").write_text("https://vigilmon.online/api/heartbeat/tok\n")
    monkeypatch.setenv("HOOK_SECRET", "whsec_c2VjcmV0")
    config, problems = validate(_config([
        {"name": "wd", "type": "heartbeat", "url_file": str(tmp_path / "url")},
        {"name": "w", "type": "webhook", "url": "http://h/", "signing_secret_env": "HOOK_SECRET"},
    ]))
    assert problems == []
    assert config is not None
    assert config.targets[0].endpoint.url == "https://vigilmon.online/api/heartbeat/tok"
    assert config.targets[0].endpoint.redacted() == "https://vigilmon.online/…"
    assert config.targets[1].signing_secret == b"whsec_c2VjcmV0"
    assert signing.signing_key(b"whsec_c2VjcmV0") == b"secret"


def test_retry_after() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert parse_retry_after("soon") is None


def test_backoff_is_exponential_with_bounded_jitter() -> None:
    settings = RetryPolicy(initial_backoff=1.0, max_backoff=60.0)
    assert [backoff_delay(n, settings, rand=lambda: 0.0) for n in (1, 2, 3, 4)] == [
        0.5, 1.0, 2.0, 4.0]
    assert backoff_delay(3, settings, rand=lambda: 1.0) == 4.0
    assert backoff_delay(20, settings, rand=lambda: 1.0) == 60.0


def test_signature_matches_the_standard_webhooks_definition() -> None:
    import base64
    import hashlib
    import hmac

    sig = signing.signature(b"key", "msg_1", 1700000000, b'{"a":1}')
    mac = hmac.new(b"key", b'msg_1.1700000000.{"a":1}', hashlib.sha256).digest()
    assert sig == "v1," + base64.b64encode(mac).decode()
    assert signing.verify(b"key", "msg_1", 1700000000, b'{"a":1}', "v1,bad " + sig)
    assert not signing.verify(b"other", "msg_1", 1700000000, b'{"a":1}', sig)


def test_store_transactions(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    hook = Enqueue("hook", "webhook", dedup_key="k", dedup_window=60)
    first = store.ingest(b"{}", [hook, Enqueue("wd", "ping", newest_only=True)], now=100)
    assert first.queued == ("hook", "wd")
    again = store.ingest(b"{}", [hook, Enqueue("wd", "ping", newest_only=True)], now=110)
    assert again.deduplicated == ("hook",)
    assert again.superseded == {"wd": 1}
    assert store.ingest(b"{}", [hook], now=161).queued == ("hook",)  # window passed
    assert {t: q.depth for t, q in store.queue_stats().items()} == {"hook": 2, "wd": 1}
    store.ingest(b"{}", [], [FiringUpdate("hh", "f1", "{}", True)], now=100)
    assert [f[0] for f in store.firing("hh", now=105, alert_ttl=10)] == ["f1"]
    assert store.firing("hh", now=111, alert_ttl=10) == []
    d = store.next_delivery("hook")
    assert d is not None
    store.dead_letter(d, "HTTP 500", now=200)
    assert store.dead_letter_counts() == {"hook": 1}
    assert store.retry_dead(None, now=201) == 1
    assert store.dead_letter_counts() == {}
    ok, _ = store.writable()
    assert ok
    store.close()


def test_delivery_ids_are_never_reused(tmp_path: Path) -> None:
    """A worker finishing a superseded ping deletes by id and must not hit the newer one."""
    store = Store(tmp_path)
    store.ingest(b"{}", [Enqueue("wd", "ping", newest_only=True)], now=1)
    (old,) = store.pending("wd")
    store.ingest(b"{}", [Enqueue("wd", "ping", newest_only=True)], now=2)  # supersedes
    store.delivered(old, now=3)  # the in-flight old ping finishes
    (new,) = store.pending("wd")
    assert new.id > old.id
    store.close()


def _tables(store: Store) -> dict[str, list[tuple[object, ...]]]:
    queries = {
        "notifications": "SELECT id, received_at, body FROM notifications ORDER BY id",
        # Not the ids themselves: one by one, a superseded ping used up an id.
        "outbox": "SELECT target, kind, notification_id, created_at, next_attempt_at "
                  "FROM outbox ORDER BY id",
        "dedup": "SELECT target, key, seen_at FROM dedup_log ORDER BY id",
        "firing": "SELECT target, fingerprint, labels, last_seen FROM firing "
                  "ORDER BY target, fingerprint",
    }
    return {name: store._db.execute(sql).fetchall() for name, sql in queries.items()}


def test_group_commit_batch_equals_one_item_after_another(tmp_path: Path) -> None:
    """A batch in one commit must store exactly what its items store one commit each
    (within a batch, dedup and superseding work in memory; across commits, in SQLite)."""
    def hook(key: str) -> Enqueue:
        return Enqueue("hook", "webhook", dedup_key=key, dedup_window=60)

    ping, fail = Enqueue("wd", "ping", newest_only=True), Enqueue("wd", "fail", newest_only=True)
    before = [IngestItem(b"old", (hook("a"), ping), (FiringUpdate("hh", "f0", "{}", True),), 1)]
    items = [
        IngestItem(b"1", (hook("a"), Enqueue("other", "webhook", dedup_key="a",
                                             dedup_window=60)), (), 10),  # a: dup for hook
        IngestItem(b"2", (hook("b"), ping), (FiringUpdate("hh", "f1", "{}", True),), 11),
        IngestItem(b"3", (hook("b"), ping), (FiringUpdate("hh", "f0", "{}", False),), 12),
        IngestItem(b"4", (hook("c"), fail), (FiringUpdate("hh", "f1", "{}", False),
                                             FiringUpdate("hh", "f2", "{}", True)), 13),
        IngestItem(b"5", (hook("a"),), (FiringUpdate("hh", "f1", "{}", True),), 80),  # expired
        IngestItem(b"6", (), (), 81),
    ]
    one_by_one, batched = Store(tmp_path / "one"), Store(tmp_path / "batch")
    for store in (one_by_one, batched):
        assert store.ingest_many(before)[0].queued == ("hook", "wd")  # type: ignore[union-attr]
    expected = [one_by_one.ingest(i.body, i.enqueues, i.firing, i.now) for i in items]
    got = batched.ingest_many(items)
    assert got == expected
    assert _tables(batched) == _tables(one_by_one)
    assert [r.superseded for r in expected] == [{}, {"wd": 1}, {"wd": 1}, {"wd": 1}, {}, {}]
    assert [r.deduplicated for r in expected] == [("hook",), (), ("hook",), (), (), ()]
    for store in (one_by_one, batched):
        store.close()


def test_group_commit_refuses_only_the_item_that_cannot_be_stored(tmp_path: Path) -> None:
    store = Store(tmp_path)
    good = IngestItem(b"{}", (Enqueue("hook", "webhook"),), (), 1)
    # A trigger makes one body unstorable, as a full disk would for one large body.
    store._db.execute("CREATE TRIGGER refuse BEFORE INSERT ON notifications "
                      "WHEN NEW.body = CAST('bad' AS BLOB) BEGIN SELECT RAISE(ABORT, 'no'); END")
    bad = IngestItem(b"bad", (Enqueue("hook", "webhook"),), (), 1)
    results = store.ingest_many([good, bad, good])
    assert isinstance(results[1], StoreError)
    assert [type(r).__name__ for r in results] == ["IngestResult", "StoreError", "IngestResult"]
    assert store.queue_stats()["hook"].depth == 2
    store.close()


def test_a_delivery_worker_survives_its_own_bug(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                ) -> None:
    """An unexpected exception in a worker's step is logged and counted, and the
    thread carries on: the delivery it was about to make is made on the next try."""
    from colossalai_exporter.bridge.metrics import BridgeStats
    from colossalai_exporter.bridge.workers import TargetWorker
    from fake_vigilmon import fake_vigilmon

    with fake_vigilmon() as vigilmon:
        config, problems = validate(_config([
            {"name": "hook", "type": "webhook", "url": vigilmon.url + "/hook"}]))
        assert problems == [] and config is not None
        store = Store(tmp_path / "state")
        store.ingest(body(alert("TrainingStalled")),
                     [Enqueue("hook", "webhook", dedup_key="k", dedup_window=60)])
        real, calls = store.next_delivery, []

        def buggy_once(target: str):  # type: ignore[no-untyped-def]
            calls.append(target)
            if len(calls) == 1:
                raise KeyError("a bug")
            return real(target)

        store.next_delivery = buggy_once  # type: ignore[method-assign]
        stats = BridgeStats()
        worker = TargetWorker(config.targets[0], store, RetryPolicy(), stats)
        with caplog.at_level("ERROR", logger="colossalai_exporter.bridge.workers"):
            worker.start()
            try:
                vigilmon.wait_for("/hook", 1, timeout=10)
            finally:
                worker.stop()
                worker.join(5)
        store.close()
    assert any("delivery worker failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert stats.deliveries["hook", "error"] == 1
    assert stats.deliveries["hook", "success"] == 1


def test_a_fail_url_inherits_everything_but_its_url() -> None:
    """Method, headers (merged, its own win by name), timeout, success codes and TLS
    default to the heartbeat's: a forgotten copy would show only when the alert resolves."""
    config, problems = validate(_config([
        {"name": "wd", "type": "heartbeat", "url": "https://v/api/heartbeat/t",
         "method": "POST", "timeout": "3s", "success_codes": [200, 202],
         "headers": {"X-Api-Key": "k1", "X-Team": "ml"},
         "tls": {"server_name": "vigilmon.internal"},
         "fail": {"url": "https://v/api/heartbeat/t/fail"}},
        {"name": "own", "type": "heartbeat", "url": "https://v/api/heartbeat/u",
         "method": "POST", "timeout": "3s", "headers": {"X-Api-Key": "k1", "X-Team": "ml"},
         "fail": {"url": "https://v/api/heartbeat/u/fail", "method": "GET", "timeout": "1s",
                  "success_codes": [204], "headers": {"x-api-key": "k2"}, "tls": {}}},
    ]))
    assert problems == [] and config is not None
    wd, own = config.targets
    assert wd.fail_endpoint is not None and own.fail_endpoint is not None
    inherited = wd.fail_endpoint
    assert (inherited.method, inherited.timeout, inherited.success_codes) == (
        "POST", 3.0, frozenset({200, 202}))
    assert inherited.headers == (("X-Api-Key", "k1"), ("X-Team", "ml"))
    assert inherited.tls == wd.endpoint.tls
    overridden = own.fail_endpoint
    assert (overridden.method, overridden.timeout, overridden.success_codes) == (
        "GET", 1.0, frozenset({204}))
    assert overridden.headers == (("X-Team", "ml"), ("x-api-key", "k2"))
    assert overridden.tls is not None and overridden.tls.server_name is None


def test_null_optional_fields_read_as_empty_and_big_numbers_in_strings_are_fine() -> None:
    """Go writes a nil map as null; a long run of digits inside a string is a string."""
    data = notification()
    data["alerts"][0].update(annotations=None, endsAt=None, generatorURL=None,  # type: ignore[index]
                             fingerprint=None)
    data["commonLabels"] = None
    data["groupLabels"] = {"job": "9" * 40 + "e999"}
    data["x"] = [1.5e308, -(2**63), 2**64 - 1]
    parsed = parse_notification(json.dumps(data).encode())
    assert parsed.alerts[0].annotations == {}
    assert parsed.alerts[0].ends_at == "" and parsed.common_labels == {}
    assert parsed.alerts[0].fingerprint == "" and parsed.alerts[0].generator_url == ""
    assert parsed.group_labels == {"job": "9" * 40 + "e999"}


def test_dedup_keys_survive_a_restart_and_pruning_forgets_them(tmp_path: Path) -> None:
    def hook(key: str) -> Enqueue:
        return Enqueue("hook", "webhook", dedup_key=key, dedup_window=3600)

    store = Store(tmp_path)
    assert store.ingest(b"{}", [hook("k1")], now=100).queued == ("hook",)
    store.close()
    store = Store(tmp_path)  # a restart: the keys come back from the log
    assert store.ingest(b"{}", [hook("k1")], now=200).deduplicated == ("hook",)
    store.prune(dedup_older_than=50, now=300)  # k1, last stored at 100, is forgotten
    assert store._db.execute("SELECT COUNT(*) FROM dedup_log").fetchone()[0] == 0
    assert store.ingest(b"{}", [hook("k1")], now=301).queued == ("hook",)
    store.close()


def test_a_rolled_back_batch_leaves_no_dedup_key_behind(tmp_path: Path) -> None:
    store = Store(tmp_path)
    hook = Enqueue("hook", "webhook", dedup_key="k", dedup_window=3600)
    store._db.execute("CREATE TRIGGER refuse BEFORE INSERT ON notifications "
                      "BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    assert isinstance(store.ingest_many([IngestItem(b"{}", (hook,), (), 1)])[0], StoreError)
    store._db.execute("DROP TRIGGER refuse")
    result = store.ingest_many([IngestItem(b"{}", (hook,), (), 2)])[0]
    assert not isinstance(result, StoreError) and result.queued == ("hook",)
    store.close()


def test_a_database_with_the_old_dedup_table_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    old = sqlite3.connect(tmp_path / "bridge.sqlite3")
    old.executescript("CREATE TABLE dedup (target TEXT NOT NULL, key TEXT NOT NULL, "
                      "seen_at REAL NOT NULL, PRIMARY KEY (target, key));"
                      "INSERT INTO dedup VALUES ('hook', 'old-key', 100);")
    old.close()
    store = Store(tmp_path)
    hook = Enqueue("hook", "webhook", dedup_key="old-key", dedup_window=3600)
    assert store.ingest(b"{}", [hook], now=200).deduplicated == ("hook",)
    tables = {r[0] for r in store._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "dedup" not in tables
    store.close()
