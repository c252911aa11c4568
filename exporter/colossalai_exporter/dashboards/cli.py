"""``colossalai-exporter dashboards``: write grafana/dashboards/*.json from their Python source.

    colossalai-exporter dashboards                # write the three dashboards
    colossalai-exporter dashboards --check        # exit 1 when a committed file is stale
    colossalai-exporter dashboards --override site.yml --output-dir /var/lib/grafana/dashboards
    colossalai-exporter dashboards --override site.yml --configmaps dashboards.yaml

Thresholds and job selectors come from the rules config (and its overrides),
so a site that changes a threshold regenerates rules and dashboards alike.
``--configmaps`` also writes them as ConfigMaps for the Grafana sidecar on
Kubernetes (:mod:`.configmaps`); in a source checkout that file is
deploy/kubernetes/dashboards.yaml, written and checked with the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colossalai_exporter import checkout
from colossalai_exporter.dashboards import chat, configmaps, nodes, training
from colossalai_exporter.dashboards.dashboard import Dashboard
from colossalai_exporter.flags import ArgumentParser
from colossalai_exporter.generated import write_or_check
from colossalai_exporter.rulesgen import config as rules_config
from colossalai_exporter.rulesgen import rules
from colossalai_exporter.rulesgen.cli import DEFAULT_CONFIG
from colossalai_exporter.rulesgen.config import RulesConfig

DEFAULT_OUTPUT_DIR = checkout.output_dir("grafana/dashboards", "dashboards")
#: the repository's committed ConfigMaps; installed, none unless asked for
DEFAULT_CONFIGMAPS = (checkout.REPO / "deploy" / "kubernetes" / "dashboards.yaml"
                      if checkout.in_checkout() else None)

BUILDERS: tuple[Callable[[RulesConfig], Dashboard], ...] = (training.build, nodes.build,
                                                           chat.build)


def text(model: dict[str, Any]) -> str:
    """The committed form: two-space indent, keys in build order, UTF-8, final newline."""
    return json.dumps(model, indent=2, ensure_ascii=False) + "\n"


def dashboards(config: RulesConfig) -> list[dict[str, Any]]:
    """Every dashboard's JSON model for a rules config."""
    return [build(config).to_json() for build in BUILDERS]


def generate(config_path: Path = DEFAULT_CONFIG, overrides: list[Path] | None = None,
             output_dir: Path = DEFAULT_OUTPUT_DIR, configmaps_file: Path | None = None,
             namespace: str = "monitoring") -> dict[Path, str]:
    """Every generated file (path -> text): one JSON file per dashboard, and with
    ``configmaps_file`` the same dashboards as sidecar ConfigMaps."""
    cfg = rules_config.load(config_path, overrides, rules.alert_names())
    files = {f"{model['uid']}.json": text(model) for model in dashboards(cfg)}
    written = {output_dir / name: body for name, body in files.items()}
    if configmaps_file is not None:
        written[configmaps_file] = configmaps.render(files, namespace)
    return written


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="colossalai-exporter dashboards",
                            description="Write the Grafana dashboards from their Python source.")
    parser.add_argument("--config.file", dest="config_file", type=Path, default=DEFAULT_CONFIG,
                        metavar="PATH", help="rules config with thresholds and selectors "
                                             "(default: the shipped rules/config.yml)")
    parser.add_argument("--override", action="append", type=Path, default=[], metavar="PATH",
                        help="YAML merged over the rules config; repeatable")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR, metavar="DIR",
                        help="where the <uid>.json files go (default: grafana/dashboards/ "
                             "in a source checkout, ./dashboards when installed)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a file differs from what would be written")
    parser.add_argument("--configmaps", type=Path, default=None, metavar="FILE",
                        help="also write the dashboards as ConfigMaps for Grafana's sidecar "
                             "(default: in a source checkout with the default --output-dir, "
                             "deploy/kubernetes/dashboards.yaml; otherwise none)")
    parser.add_argument("--namespace", default="monitoring",
                        help="namespace of the ConfigMaps (Grafana's sidecar namespace; "
                             "default monitoring)")
    args = parser.parse_args(argv)
    if args.configmaps is None and args.output_dir == DEFAULT_OUTPUT_DIR:
        # the repository's two committed forms of the dashboards move together
        args.configmaps = DEFAULT_CONFIGMAPS
    files = generate(args.config_file, args.override, args.output_dir, args.configmaps,
                     args.namespace)
    return write_or_check(files, check=args.check, regenerate="colossalai-exporter dashboards")
