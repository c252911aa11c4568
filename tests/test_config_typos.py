"""One corpus of typos, fed to every component's config file through its real CLI.

Issue 18: the same slip (a misspelt key at any depth, a duration in words, a
value outside its set, a TLS key misspelt) must get the same treatment in every
file: exit 2, one line (``bridge check``: one line per problem) naming the
file, the key's path and, for an unknown key, the keys that exist. None of
these may start a daemon on its defaults.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli

# (component, file text, what the line must say). Each component reads its file with
# its own flag; see COMMANDS.
CORPUS: list[tuple[str, str, str]] = [
    # a misspelt key at the top
    ("node", "listen_adress: ':1'", "unknown key `listen_adress` (known: web, log,"),
    ("probe", "listen_adress: ':1'", "unknown key `listen_adress` (known: web, log,"),
    ("web", "tls_server_confg: {}", "unknown key `tls_server_confg` (known: tls_server_config,"),
    ("bridge", "listen_adress: ':1'", "unknown key `listen_adress` (known: delivery,"),
    ("rules", "thresolds: {}", "unknown key `thresolds` (known: runbook_url,"),
    # a misspelt key one level down, in the sections the daemons share
    ("node", "web: {listen_adress: ':1'}", "web: unknown key `listen_adress` "
                                           "(known: listen_address, config_file)"),
    ("probe", "web: {listen_adress: ':1'}", "web: unknown key `listen_adress` "
                                            "(known: listen_address, config_file)"),
    ("bridge", "web: {listen_adress: ':1'}", "web: unknown key `listen_adress` "
                                             "(known: listen_address, config_file)"),
    ("web", "http_server_config: {header: {}}", "http_server_config: unknown key `header`"),
    ("bridge", "receiver: {bearer_tokn: x}", "receiver: unknown key `bearer_tokn`"),
    ("rules", "thresholds: {straggler_ration: 2}", "thresholds: unknown key `straggler_ration`"),
    # deeper: in a list or a map of sections
    ("node", "disks: [{name: c, path: /c, mountpoint: true}]",
     "disks[0]: unknown key `mountpoint`"),
    ("probe", "modules: {m: {prober: http, http: {heders: {}}}}",
     "modules.m.http: unknown key `heders`"),
    ("bridge", "targets: [{name: w, type: heartbeat, url: 'https://x/y', "
               "fail: {url: 'https://x/f', urll: x}}]",
     "targets[w].fail: unknown key `urll`"),
    # the one TLS client block, misspelt
    ("probe", "modules: {m: {prober: http, http: {tls_config: {insecure_skip_verfy: true}}}}",
     "modules.m.http.tls_config: unknown key `insecure_skip_verfy` (known: ca_file,"),
    ("bridge", "targets: [{name: w, type: heartbeat, url: 'https://x/y', "
               "tls: {insecure_skip_verfy: true}}]",
     "targets[w].tls: unknown key `insecure_skip_verfy` (known: ca_file,"),
    # a duration in words
    ("node", "gpu: {timeout_seconds: 5 min}", "gpu.timeout_seconds: '5 min' is not a duration"),
    ("probe", "modules: {m: {prober: http, timeout: 5 min}}",
     "modules.m.timeout: '5 min' is not a duration"),
    ("bridge", "delivery: {initial_backoff: 5 min}",
     "delivery.initial_backoff: '5 min' is not a duration"),
    ("rules", "thresholds: {checkpoint_failure_window: 5 min}",
     "thresholds.checkpoint_failure_window: '5 min' is not a Prometheus duration"),
    # a value outside its set
    ("node", "log: {level: verbose}", "log.level: invalid enum value 'verbose' (one of: debug,"),
    ("probe", "log: {level: verbose}", "log.level: invalid enum value 'verbose' (one of: debug,"),
    ("bridge", "log: {level: verbose}", "log.level: invalid enum value 'verbose' (one of: debug,"),
    ("web", "tls_server_config: {cert_file: a, key_file: b, min_version: TLS14}",
     "tls_server_config.min_version: invalid enum value 'TLS14' (one of: TLS10,"),
    ("bridge", "targets: [{name: w, type: heartbeat, url: 'https://x/y', "
               "tls: {min_version: TLS14}}]",
     "targets[w].tls.min_version: invalid enum value 'TLS14' (one of: TLS10,"),
]

BRIDGE_BASE = "state_dir: state\n"
BRIDGE_TARGET = "targets: [{name: ok, type: heartbeat, url: 'https://x/y'}]\n"


def command(component: str, path: Path, tmp_path: Path) -> list[str]:
    if component == "node":
        return ["node", "--no-collector.gpu", "--config.file", str(path)]
    if component == "probe":
        return ["probe", "--config.file", str(path)]
    if component == "web":  # the web config, read by every daemon the same way
        return ["node", "--no-collector.gpu", "--web.config.file", str(path)]
    if component == "bridge":
        return ["bridge", "--config.file", str(path)]
    return ["rules", "--override", str(path), "--output-dir", str(tmp_path / "out"),
            "--kubernetes-output", ""]


def file_text(component: str, text: str) -> str:
    if component != "bridge":
        return text + "\n"
    # A valid bridge config around the typo, so that the typo is its only problem.
    return BRIDGE_BASE + text + "\n" + ("" if text.startswith("targets:") else BRIDGE_TARGET)


@pytest.mark.parametrize(("component", "text", "needle"), CORPUS,
                         ids=[f"{c}:{t[:40]}" for c, t, _ in CORPUS])
def test_every_component_names_the_typo_in_one_line_and_exits_2(
        tmp_path: Path, component: str, text: str, needle: str) -> None:
    path = tmp_path / f"{component}.yml"
    path.write_text(file_text(component, text))
    result = run_cli(*command(component, path, tmp_path), cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"colossalai-exporter: error: {path}: "), lines[0]
    assert needle in lines[0], lines[0]
    if component == "bridge":  # `bridge check` lists the same problem, alone
        check = run_cli("bridge", "check", "--config.file", str(path), cwd=tmp_path)
        assert check.returncode == 2, check.stderr
        assert check.stderr.strip().splitlines() == [lines[0].removeprefix(
            "colossalai-exporter: error: ")]
