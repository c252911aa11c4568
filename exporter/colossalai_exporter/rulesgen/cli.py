"""``colossalai-exporter rules``: render the rule files from rules/config.yml.

    colossalai-exporter rules                 # write rules/*.rules.yml and the PrometheusRule
    colossalai-exporter rules --check         # exit 1 when a committed file is stale
    colossalai-exporter rules --override site.yml --output-dir /etc/prometheus/rules
                                              # your thresholds, rules only

Bad config (unknown key, wrong type, malformed duration) is one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path

from colossalai_exporter import checkout
from colossalai_exporter.flags import ArgumentParser
from colossalai_exporter.generated import write_or_check
from colossalai_exporter.rulesgen import config as rules_config
from colossalai_exporter.rulesgen import render, rules

# In a checkout the repository's files; installed, the wheel's config and outputs in
# the working directory, with no PrometheusRule unless asked for (checkout.py).
DEFAULT_CONFIG = checkout.rules_config()
DEFAULT_RULES_DIR = checkout.output_dir("rules", "rules")
DEFAULT_KUBERNETES: Path | None = (checkout.REPO / "deploy" / "kubernetes" /
                                   "prometheusrule.yaml" if checkout.in_checkout() else None)


def generate(config_path: Path = DEFAULT_CONFIG, overrides: list[Path] | None = None,
             rules_dir: Path = DEFAULT_RULES_DIR,
             kubernetes_path: Path | None = DEFAULT_KUBERNETES) -> dict[Path, str]:
    """Every generated file (path -> text) for a config and its overrides."""
    cfg = rules_config.load(config_path, overrides, rules.alert_names())
    return render.outputs(cfg, rules.build(cfg), rules_dir, kubernetes_path)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="colossalai-exporter rules",
                            description="Render alerting and recording rules from one config.")
    parser.add_argument("--config.file", dest="config_file", type=Path, default=DEFAULT_CONFIG,
                        metavar="PATH", help="rules config (default: the shipped one, "
                                             "rules/config.yml)")
    parser.add_argument("--override", action="append", type=Path, default=[], metavar="PATH",
                        help="YAML merged over the config (any subset of its keys); repeatable")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_RULES_DIR, metavar="DIR",
                        help="where the *.rules.yml files go (default: rules/)")
    parser.add_argument("--kubernetes-output", default=None, metavar="PATH",
                        help="the PrometheusRule file; '' to skip (default: "
                             "deploy/kubernetes/prometheusrule.yaml in a source checkout "
                             "when --output-dir is not given, none otherwise)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a file differs from what would be written")
    args = parser.parse_args(argv)
    if args.kubernetes_output is None:
        # Rules written elsewhere (a site's thresholds) leave the checkout's PrometheusRule
        # alone: rendering an override into /tmp must not rewrite the shipped file.
        kubernetes = DEFAULT_KUBERNETES if args.output_dir == DEFAULT_RULES_DIR else None
    else:
        kubernetes = Path(args.kubernetes_output) if args.kubernetes_output else None
    files = generate(args.config_file, args.override, args.output_dir, kubernetes)
    return write_or_check(files, check=args.check, regenerate="colossalai-exporter rules")
