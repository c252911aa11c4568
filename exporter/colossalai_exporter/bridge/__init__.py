"""The bridge: Alertmanager webhooks in, Vigilmon heartbeats and webhooks out.

* :mod:`.alertmanager` parses webhook version 4 bodies into typed objects (pure).
* :mod:`.matchers` parses and applies label matchers (``=``, ``!=``, ``=~``, ``!~``).
* :mod:`.config` reads and validates ``bridge.yml``.
* :mod:`.store` is the durable outbox: SQLite in WAL mode, ``synchronous=FULL``.
* :mod:`.ingest` turns a stored notification into per-target deliveries.
* :mod:`.sender` makes the outbound HTTP requests; :mod:`.signing` signs them.
* :mod:`.workers` delivers with retries; :mod:`.health_heartbeat` pings on a schedule.
* :mod:`.app` is the HTTP app (``/alertmanager``, ``/metrics``, ``/health``).
* :mod:`.cli` is ``colossalai-exporter bridge [check|outbox]``.
"""
