"""The chat prober: blackbox-exporter style ``/probe`` for ColossalAI chat and inference servers.

* :mod:`.targets` parses a ``target`` parameter, resolves it with a deadline and
  checks the resolved addresses against the allow list (the prober is not an
  open relay).
* :mod:`.config` holds modules (built in and from YAML) and the prober's config.
* :mod:`.http` makes one HTTP request over ``http.client`` on a socket we
  connect ourselves, timing each phase.
* :mod:`.modules` runs a module's steps against a target and classifies failures.
* :mod:`.metrics` turns a probe outcome into metric families and keeps the
  prober's own counters.
* :mod:`.server` serves ``/probe``, ``/metrics`` and ``/health``; :mod:`.cli`
  is ``colossalai-exporter probe``.
"""
