"""Outgoing HTTP that sends only where and what the config says, for every component
that calls out with a secret in the URL or the body: the bridge's deliveries and the
training heartbeats.

``trust_env = False``: ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` would route every
request, token in the URL, through a host the config does not name, and
``~/.netrc`` would add credentials the config does not hold. Callers also pass
``allow_redirects=False`` on every request: a redirect would send the token to an
address the config never named. A CA bundle, the one thing the environment could
usefully give, comes from the config's own ``tls`` settings where a component has
them (the bridge's targets).
"""

from __future__ import annotations

import requests


def session() -> requests.Session:
    """A requests session that takes nothing from the environment."""
    new = requests.Session()
    new.trust_env = False
    return new
