"""Where this copy runs from: a source checkout, or an installed wheel.

The generators' defaults differ between the two. In a checkout, ``rules``
and ``dashboards`` rewrite the repository's committed files (and ``--check``
compares them). Installed, there is no repository: the rules config ships
inside the package (the wheel carries rules/config.yml as
``colossalai_exporter/rulesgen/config.yml``) and outputs default to the
working directory. The repository-only tools live in tools/, outside the
package.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# exporter/colossalai_exporter -> the repository root, when there is one
REPO = PACKAGE.parents[1]
_PACKAGED_RULES_CONFIG = PACKAGE / "rulesgen" / "config.yml"
# The wheel carries the deploy/ files `demo --alerting` starts from (pyproject.toml).
_PACKAGED_DEPLOY = PACKAGE / "deploy"


def in_checkout() -> bool:
    """True when the package runs from the repository's exporter/ folder."""
    return (REPO / "pyproject.toml").is_file() and (REPO / "rules" / "config.yml").is_file()


def rules_config() -> Path:
    """The shipped rules config: the repository's in a checkout, else the wheel's copy."""
    return REPO / "rules" / "config.yml" if in_checkout() else _PACKAGED_RULES_CONFIG


def output_dir(in_repo: str, installed: str) -> Path:
    """``REPO/in_repo`` in a checkout; ``installed``, relative to the working directory,
    otherwise."""
    return REPO / in_repo if in_checkout() else Path(installed)


def deploy_file(relative: str) -> Path:
    """A shipped file under deploy/: the repository's in a checkout, else the wheel's copy."""
    return (REPO / "deploy" if in_checkout() else _PACKAGED_DEPLOY) / relative
