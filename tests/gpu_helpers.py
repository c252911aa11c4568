"""Helpers for the gpu collector tests: fake NVML scenarios and reading families.

The fake NVML (tests/fake_nvml/pynvml.py) is a module named ``pynvml``: a
process whose ``PYTHONPATH`` starts with its folder imports it instead of
nvidia-ml-py. The agent's NVML worker inherits the agent's environment, so
:func:`fake_nvml_env` (for an agent started as a subprocess) and
:func:`use_fake_nvml` (for a collector built in the test's own process) are
all a test needs; the product has no switch for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from colossalai_exporter.web.exposition import CollectedFamilies

#: the folder holding the fake ``pynvml``
FAKE_NVML_DIR = Path(__file__).resolve().parent / "fake_nvml"
#: names the scenario file the fake reads (tests/fake_nvml/pynvml.py)
SCENARIO_ENV = "FAKE_NVML_SCENARIO"


def _with_fake_first(python_path: str) -> str:
    return os.pathsep.join(part for part in (str(FAKE_NVML_DIR), python_path) if part)


def fake_nvml_env(scenario: Path | str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the fake NVML reading
    ``scenario`` for every NVML worker started under it."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = _with_fake_first(env.get("PYTHONPATH", ""))
    env[SCENARIO_ENV] = str(scenario)
    return env


def use_fake_nvml(monkeypatch: pytest.MonkeyPatch, scenario: Path | str) -> None:
    """Workers started by this process from now on (until the test ends) read the fake."""
    monkeypatch.setenv("PYTHONPATH", _with_fake_first(os.environ.get("PYTHONPATH", "")))
    monkeypatch.setenv(SCENARIO_ENV, str(scenario))


def without_fake_nvml(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the fake removed, so a worker started under it imports the real pynvml."""
    clean = dict(env)
    clean.pop(SCENARIO_ENV, None)
    parts = [p for p in clean.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).resolve() != FAKE_NVML_DIR]
    clean["PYTHONPATH"] = os.pathsep.join(parts)
    return clean


def fake_dev(path: Path, *names: str) -> Path:
    """A folder standing for ``/dev`` (the gpu collector's ``dev_root``) holding ``names``.

    The NVIDIA driver creates a character device per GPU (``/dev/nvidia0``, …) plus
    ``nvidiactl`` and ``nvidia-uvm``; the collector only looks at the names, so
    empty files stand for them (making real device nodes needs CAP_MKNOD).
    """
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (path / name).touch()
    return path


def gpu(index: int, **overrides: Any) -> dict[str, Any]:
    """A fully supported fake GPU; ``overrides`` change or (with None) drop keys."""
    spec: dict[str, Any] = {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-{index:08x}-1111-2222-3333-444455556666",
        "memory_total": 80 * 2**30,
        "memory_used": (index + 1) * 2**30,
        "utilization": 10 * index,
        "temperature": 40 + index,
        "power_mw": 100_000 + 1000 * index,
        "ecc": {"corrected": index, "uncorrected": 0},
    }
    for key, value in overrides.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return spec


class Scenario:
    """A fake NVML scenario file that a test rewrites while the worker reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def write(self, **data: Any) -> Scenario:
        self.data = data
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        # A rename is atomic, so the worker never reads half a file.
        os.replace(tmp, self.path)
        return self

    def update(self, **data: Any) -> Scenario:
        return self.write(**{**self.data, **data})

    def hung_pids(self) -> set[int]:
        """Worker processes that entered a hang (the fake logs them)."""
        log = Path(f"{self.path}.hung")
        if not log.exists():
            return set()
        return {int(line.split()[0]) for line in log.read_text().splitlines() if line}


def registry_of(families: Sequence[Metric]) -> CollectorRegistry:
    """A registry serving exactly ``families``, for get_sample_value and exposition."""

    registry = CollectorRegistry()
    registry.register(CollectedFamilies(families))
    return registry


def exposition(families: Sequence[Metric]) -> str:
    return generate_latest(registry_of(families)).decode()


def series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]
