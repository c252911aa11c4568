"""The shipped rule files load unchanged in vmalert (Debian's victoria-metrics package):
its dry run parses every expression with MetricsQL and every annotation and label
template with vmalert's template functions, as it would at start; and vmagent takes
the shipped scrape configs once the Prometheus-only sections are left out
(docs/deploy.md, "Large fleets")."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from conftest import REPO, require_binary

RULE_FILES = sorted((REPO / "rules").glob("*.rules.yml"))


def _dry_run(*rule_files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("vmalert"), "-dryRun", "-loggerLevel=ERROR",
                           *(f"-rule={path}" for path in rule_files)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_vmalert_accepts_the_shipped_rule_files_unchanged() -> None:
    assert RULE_FILES
    result = _dry_run(*RULE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dry_run_rejects_what_vmalert_could_not_run(tmp_path: Path) -> None:
    """The check above is worth something: one rule file changed to call a template
    function vmalert lacks, or to hold an expression MetricsQL cannot parse, fails it."""
    text = RULE_FILES[0].read_text()
    assert "{{ $labels." in text and ") > 0" in text
    broken = {"annotations": text.replace("{{ $labels.", "{{ nosuchfunction $labels.", 1),
              "expression": text.replace(") > 0", ") > > 0", 1)}
    for what, rules in broken.items():
        path = tmp_path / f"broken-{what}.rules.yml"
        path.write_text(rules)
        result = _dry_run(path)
        output = result.stdout + result.stderr
        assert result.returncode != 0, f"{what}: {output}"
        assert f"invalid {what}" in output, output


def test_vmagent_takes_the_shipped_scrape_configs(tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml without what only a rule evaluator reads
    (``rule_files``, ``alerting``, ``global.evaluation_interval``, each of which vmagent
    refuses) is a vmagent scrape config as it stands."""
    shipped = REPO / "deploy" / "prometheus"
    config = yaml.safe_load((shipped / "prometheus.yml").read_text())
    assert {"rule_files", "alerting", "scrape_configs"} <= set(config)
    for section in ("rule_files", "alerting"):
        del config[section]
    del config["global"]["evaluation_interval"]
    path = tmp_path / "scrape.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([require_binary("vmagent"), f"-promscrape.config={path}",
                             "-promscrape.config.dryRun", "-loggerLevel=ERROR"],
                            capture_output=True, text=True, timeout=60, check=False,
                            cwd=shipped)  # its file_sd paths are relative to it
    assert result.returncode == 0, result.stdout + result.stderr
