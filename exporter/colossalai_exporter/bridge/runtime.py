"""Start and stop the bridge's parts in the right order.

Start: open the store, start the delivery workers (pending deliveries from
before a crash resume at once), the health-heartbeat schedulers, the group
committer and the maintenance thread, then serve HTTP. Stop (SIGTERM): stop
accepting and finish in-flight requests first (so every 200 is committed),
then the committer, then the workers — each finishes the request it is
sending, bounded by its timeout — then close the store.
"""

from __future__ import annotations

import logging
import threading

from colossalai_exporter.bridge.app import Bridge, build_app
from colossalai_exporter.bridge.config import BridgeConfig
from colossalai_exporter.bridge.health_heartbeat import HealthHeartbeat
from colossalai_exporter.bridge.metrics import BridgeStats
from colossalai_exporter.bridge.store import Store, StoreError
from colossalai_exporter.bridge.workers import TargetWorker
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.web import ServerHandle, WebConfig, serve
from colossalai_exporter.web.auth import BasicAuthenticator

log = logging.getLogger(__name__)
PRUNE_INTERVAL_SECONDS = 60.0


class BridgeRuntime:
    def __init__(self, config: BridgeConfig, web_config: WebConfig) -> None:
        if config.bearer_token and web_config.basic_auth_users:
            raise ConfigError("receiver.bearer_token and the web config's basic_auth_users "
                              "cannot both be used: Alertmanager sends one Authorization "
                              "header")
        self.config = config
        self.web_config = web_config
        for warning in config.warnings:
            log.warning(warning)
        try:
            self.store = Store(config.state_dir)
        except StoreError as exc:
            raise ConfigError(str(exc)) from None
        self.stats = BridgeStats()
        self.workers = [TargetWorker(t, self.store, config.delivery, self.stats)
                        for t in config.targets if t.kind in ("heartbeat", "webhook")]
        self.schedulers = {t.name: HealthHeartbeat(t, self.store, self.stats)
                           for t in config.targets if t.kind == "health_heartbeat"}
        self.bridge = Bridge(config, self.store, self.stats,
                             {w.target.name: w for w in self.workers},
                             dict(self.schedulers))
        self._stop = threading.Event()
        self._maintenance = threading.Thread(target=self._maintain, name="bridge-maintenance",
                                             daemon=True)
        self.server: ServerHandle | None = None

    def start(self, listen_address: str) -> ServerHandle:
        try:
            pending = self.store.queue_stats()
            self.store.resume()
        except StoreError as exc:
            raise ConfigError(str(exc)) from None
        if pending:
            log.info("resuming pending deliveries", extra={
                "pending": sum(q.depth for q in pending.values())})
        for worker in self.workers:
            worker.start()
        for scheduler in self.schedulers.values():
            scheduler.start()
        self.bridge.committer.start()
        self._maintenance.start()
        authenticator = BasicAuthenticator(self.web_config.basic_auth_users)
        app = build_app(self.bridge, authenticator)
        self.server = serve(app, listen_address, self.web_config, name="bridge",
                            on_refused=self.bridge.stats.add_rejected)
        return self.server

    def _maintain(self) -> None:
        window = max([t.dedup_window for t in self.config.targets if t.kind == "webhook"],
                     default=0.0)
        while not self._stop.wait(PRUNE_INTERVAL_SECONDS):
            try:
                self.store.prune(window)
            except StoreError as exc:
                log.error("pruning the store failed", extra={"err": str(exc)})

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        # The server has answered its in-flight requests (each after its commit);
        # the committer stores anything still queued before the store closes.
        self.bridge.committer.stop()
        self._stop.set()
        parts: list[TargetWorker | HealthHeartbeat] = [*self.workers,
                                                       *self.schedulers.values()]
        for part in parts:
            part.stop()
        for part in parts:
            part.join(part.target.endpoint.timeout + 2.0)
        self._maintenance.join(2.0)
        self.store.close()
        log.info("bridge stopped")
