"""The product works from its wheel: the commands docs/ gives users, run from an
installed copy with no repository next to it.

Builds the wheel offline (hatchling from the dev extra, --no-build-isolation),
installs it without dependencies into a folder first on PYTHONPATH (the
dependencies come from the test environment), and runs each command from an
empty working directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import ServerProcess, free_port, http_get, require_binary, wait_until

REPO = Path(__file__).resolve().parents[1]
# One wheel, built once from the source tree, serves every test here: one xdist worker.
pytestmark = pytest.mark.xdist_group("wheel")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the wheel is installed into."""
    root = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(root / "dist"), str(REPO)],
        capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr
    (wheel,) = (root / "dist").glob("colossalai_exporter-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "colossalai_exporter/rulesgen/config.yml" in names
    # The training extra must not make pip resolve another torch (issue 18).
    (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(metadata_name).decode().splitlines()
    requires = [line for line in metadata if line.startswith("Requires-Dist:")]
    assert requires and not [r for r in requires if "torch" in r or "colossalai" in r], requires
    assert "Provides-Extra: training" in metadata
    # Test aids stay out of the product (issue 18): no fake NVML in the wheel.
    assert not [name for name in names if "fake" in name], names
    site = root / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
         str(site), str(wheel)], capture_output=True, text=True, timeout=300, check=False)
    assert install.returncode == 0, install.stderr
    return site


def run(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "colossalai_exporter", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_the_installed_copy_is_the_one_that_runs(installed: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    where = subprocess.run([sys.executable, "-c", "import colossalai_exporter as p; "
                            "print(p.__file__)"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert where.startswith(str(installed)), where


def test_rules_with_a_site_override_as_docs_rules_md_shows(installed: Path,
                                                           tmp_path: Path) -> None:
    (tmp_path / "site.yml").write_text(yaml.safe_dump(
        {"selectors": {"training": 'job=~"llama-.+"'}}))
    result = run(installed, tmp_path, "rules", "--override", "site.yml", "--output-dir",
                 "out", "--kubernetes-output", "")
    assert result.returncode == 0, result.stderr
    written = sorted(p.name for p in (tmp_path / "out").glob("*.rules.yml"))
    assert written == sorted(p.name for p in (REPO / "rules").glob("*.rules.yml"))
    assert 'job=~"llama-.+"' in (tmp_path / "out" / "colossalai-training.rules.yml").read_text()
    check = subprocess.run([require_binary("promtool"), "check", "rules",
                            *map(str, (tmp_path / "out").glob("*.rules.yml"))],
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    # Without --output-dir: ./rules, and no PrometheusRule anywhere.
    again = run(installed, tmp_path, "rules")
    assert again.returncode == 0, again.stderr
    assert len(list((tmp_path / "rules").glob("*.rules.yml"))) == len(written)
    assert not list(installed.rglob("prometheusrule.yaml"))


def test_dashboards_from_the_shipped_thresholds(installed: Path, tmp_path: Path) -> None:
    result = run(installed, tmp_path, "dashboards", "--output-dir", "dash")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "dash").glob("*.json")) == sorted(
        p.name for p in (REPO / "grafana" / "dashboards").glob("*.json"))
    assert not (tmp_path / "dashboards.yaml").exists()  # ConfigMaps only when asked for
    result = run(installed, tmp_path, "dashboards", "--output-dir", "dash", "--configmaps",
                 "dashboards.yaml")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "dashboards.yaml").read_text() == (
        REPO / "deploy" / "kubernetes" / "dashboards.yaml").read_text()


def test_the_one_host_folder_of_demo_alerting_from_the_installed_copy(
        installed: Path, tmp_path: Path) -> None:
    """`demo --alerting` writes its configs from the deploy/ files the wheel carries: the
    same folder as from the checkout (but for the random bridge token)."""
    code = ("import sys; from pathlib import Path; from colossalai_exporter.demo import onehost;"
            " onehost.write(Path(sys.argv[1]), '127.0.0.1', onehost.Ports())")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "wheel")], cwd=tmp_path,
                   env=env, timeout=120, check=True)
    from colossalai_exporter.demo import onehost
    onehost.write(tmp_path / "checkout", "127.0.0.1", onehost.Ports())
    for relative in ("prometheus/prometheus.yml", "alertmanager/templates/slack.tmpl",
                     "prometheus/rules/colossalai-training.rules.yml"):
        assert (tmp_path / "wheel" / relative).read_text() == \
            (tmp_path / "checkout" / relative).read_text(), relative
    wheel_am = (tmp_path / "wheel" / "alertmanager/alertmanager.yml").read_text()
    assert wheel_am.replace(str(tmp_path / "wheel"), "") == \
        (tmp_path / "checkout" / "alertmanager/alertmanager.yml").read_text().replace(
            str(tmp_path / "checkout"), "")


def test_the_repository_tools_are_not_in_the_product(installed: Path, tmp_path: Path) -> None:
    # docs/metrics.md and the dashboard PNGs are written by tools/, which only this
    # repository runs; the wheel has neither them nor a command for them.
    package = installed / "colossalai_exporter"
    assert not [p for p in package.rglob("*.py")
                if p.stem in ("docsgen", "metrics_docs", "render_png", "k8s_dashboards")]
    result = run(installed, tmp_path, "docs")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "unknown command 'docs'" in result.stderr


def test_the_daemons_and_the_monitor_run_from_the_installed_copy(installed: Path,
                                                                  tmp_path: Path) -> None:
    """What docs/ tells users to run, from the wheel in an empty folder: a training
    rank's monitor publishing, the node agent serving that rank, the prober, and
    `bridge check` on the shipped example (which names files this machine lacks)."""
    env = {**os.environ, "PYTHONPATH": str(installed), "COLOSSALAI_EXPORTER_RUN_DIR":
           str(tmp_path / "run"), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    monitor_port = free_port()
    rank_log = (tmp_path / "rank.log").open("w")
    rank = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from colossalai_exporter import TrainingMonitor\n"
         f"m = TrainingMonitor(port={monitor_port})\n"
         "for _ in range(3):\n"
         "    with m.step():\n"
         "        pass\n"
         "sys.stdin.read()\n"
         "m.close()\n"],
        cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=rank_log)
    servers: list[ServerProcess] = []
    try:
        node_port, probe_port = free_port(), free_port()
        servers.append(ServerProcess(
            ["node", "--no-collector.gpu", "--web.listen-address", f"127.0.0.1:{node_port}",
             "--ranks.run-dir", str(tmp_path / "run")], node_port, env, cwd=tmp_path))
        servers.append(ServerProcess(
            ["probe", "--web.listen-address", f"127.0.0.1:{probe_port}"], probe_port, env,
            cwd=tmp_path))
        for server in servers:
            server.wait_ready()

        def rank_served() -> bool:
            body = http_get(servers[0].url + "/metrics")[2].decode()
            return 'colossalai_rank_up{' in body and 'rank="0"' in body
        wait_until(rank_served, 30, what="the installed agent to serve the installed rank")
        health = f"http://127.0.0.1:{monitor_port}/health"
        wait_until(lambda: http_get(health)[0] == 200, 30,
                   what=f"the installed monitor's {health}")
        status, _, body = http_get(servers[1].url + "/metrics")
        assert status == 200 and b"colossalai_exporter_build_info" in body, body
    finally:
        for server in servers:
            server.close()
        assert rank.stdin is not None
        rank.stdin.close()
        rank.wait(30)
        rank_log.close()
    check = run(installed, tmp_path, "bridge", "check", "--config.file",
                str(REPO / "deploy" / "bridge" / "bridge.example.yml"))
    # The example names /etc and /var paths this machine does not have: each is one
    # problem line, exit 2, and nothing raised.
    assert check.returncode in (0, 2), check.stderr
    assert "Traceback" not in check.stderr
