"""``colossalai-exporter probe``: run the chat prober."""

from __future__ import annotations

import logging

from colossalai_exporter.flags import ArgumentParser, add_common_flags
from colossalai_exporter.probe.config import DEFAULT_PORT, load_config
from colossalai_exporter.probe.server import Prober, build_app
from colossalai_exporter.web import App, serve, stop_on_signals
from colossalai_exporter.web.auth import BasicAuthenticator

log = logging.getLogger("colossalai_exporter.probe")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="colossalai-exporter probe",
        description="Blackbox-style prober for ColossalAI chat and inference servers: "
                    "/probe?target=...&module=...")
    add_common_flags(parser, DEFAULT_PORT)
    parser.add_argument("--probe.max-concurrent", dest="max_concurrent", type=int,
                        default=None, metavar="N",
                        help="probes run at once before answering 503 (default 32)")
    args = parser.parse_args(argv)
    if args.max_concurrent is not None and args.max_concurrent < 1:
        parser.error("--probe.max-concurrent must be at least 1")
    config = load_config(args)
    config.daemon.start_logging()
    web_config = config.daemon.web_config()
    prober = Prober(config)
    app = App(authenticator=BasicAuthenticator(web_config.basic_auth_users),
              extra_headers=web_config.headers, max_body_bytes=0)
    stop = stop_on_signals()
    try:
        handle = serve(build_app(prober, app), config.daemon.listen_address, web_config,
                       name="probe")
        log.info("modules loaded", extra={"modules": ",".join(sorted(config.modules))})
        handle.wait(stop)
    finally:
        prober.close()
    return 0
