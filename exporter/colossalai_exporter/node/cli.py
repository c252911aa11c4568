"""``colossalai-exporter node``: run the per-node agent.

Start-up order matters for the first scrape (goal: within 0.5 s of starting):
the NVML worker process is started as soon as the configuration is read, and
only then are prometheus_client, uvicorn and the collectors imported, so that
the worker's own interpreter boots on another core meanwhile instead of after.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from colossalai_exporter.flags import ArgumentParser, add_common_flags
from colossalai_exporter.node.config import DEFAULT_PORT, NodeConfig, add_node_flags, load_config

if TYPE_CHECKING:
    from colossalai_exporter.node.agent import Agent
    from colossalai_exporter.node.base import NodeCollector
    from colossalai_exporter.node.blocking import BlockingCalls
    from colossalai_exporter.node.gpu.worker import Worker

log = logging.getLogger("colossalai_exporter.node")


def start_gpu_worker(config: NodeConfig) -> Worker | None:
    """The NVML worker, started before the heavy imports; None with the gpu collector off."""
    if not config.collectors["gpu"]:
        return None
    from colossalai_exporter.node.gpu.worker import Worker

    return Worker()


def build_agent(config: NodeConfig, gpu_worker: Worker | None = None) -> Agent:
    """The agent with the configured collectors; it owns ``gpu_worker`` from here on."""
    from colossalai_exporter.node.agent import Agent
    from colossalai_exporter.node.blocking import BlockingCalls

    # One runner for the disk checks and the run directory's read: a scrape's file
    # system calls cost one hand-over to one thread (see node/blocking.py).
    # Threads: one per hung path or run directory at most, plus one going in order.
    fs_calls = BlockingCalls("fs", max_threads=2 + 2 * len(config.disks))
    return Agent(build_collectors(config, gpu_worker, fs_calls),
                 scrape_timeout=config.scrape_timeout, calls=fs_calls)


def build_collectors(config: NodeConfig, gpu_worker: Worker | None = None,
                     fs_calls: BlockingCalls | None = None) -> list[NodeCollector]:
    """The switched-on collectors of node/collectors.py's registry, in its order."""
    from colossalai_exporter.node import collectors

    return collectors.build(config, collectors.Built(gpu_worker, fs_calls))


def report_first_scrape(agent: Agent) -> None:
    """Say plainly, once at start-up, which collectors are down and why (no GPU, say)."""
    list(agent.collect())
    for name, state in sorted(agent.states.items()):
        if state.up:
            log.info("collector ready", extra={"collector": name})
        else:
            log.warning(f"collector {name} is down: {state.message} (reason {state.reason}); "
                        "the other collectors are served",
                        extra={"collector": name, "reason": state.reason})


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        from colossalai_exporter.node import check

        return check.main(argv[1:])
    parser = ArgumentParser(prog="colossalai-exporter node",
                            description="Per-node agent: GPUs, host memory, disks, "
                                        "rendezvous, local training ranks.",
                            epilog="Also: 'colossalai-exporter node check' checks this "
                                   "node's GPUs, disks and kernel-logged Xids once and exits "
                                   "0 or 1, for Slurm's HealthCheckProgram.")
    add_common_flags(parser, DEFAULT_PORT)
    add_node_flags(parser)
    args = parser.parse_args(argv)
    config = load_config(args)
    config.daemon.start_logging()
    gpu_worker = start_gpu_worker(config)
    from colossalai_exporter.node.agent import build_app
    from colossalai_exporter.web import App, serve
    from colossalai_exporter.web.auth import BasicAuthenticator
    from colossalai_exporter.web.server import stop_on_signals

    # The agent owns the worker from here on: whatever fails below, close() stops it.
    agent = build_agent(config, gpu_worker)
    try:
        web_config = config.daemon.web_config()
        app = App(authenticator=BasicAuthenticator(web_config.basic_auth_users),
                  extra_headers=web_config.headers, max_body_bytes=0)
        stop = stop_on_signals()
        handle = serve(build_app(agent, app), config.daemon.listen_address, web_config,
                       name="node")
        threading.Thread(target=report_first_scrape, args=(agent,), daemon=True).start()
        handle.wait(stop)
    finally:
        agent.close()
    return 0
