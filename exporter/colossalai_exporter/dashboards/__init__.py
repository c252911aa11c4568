"""Grafana dashboards for colossalai-exporter, generated from Python.

``colossalai-exporter dashboards`` writes ``grafana/dashboards/*.json`` from
the definitions in :mod:`.training`, :mod:`.nodes` and :mod:`.chat`, built with
the small typed panel builder in :mod:`.model` and laid out by :mod:`.layout`.
Thresholds (straggler ratio, GPU memory percent, disk bytes, chat latency) and
the job selectors come from the rules config, so a dashboard's red line is the
alert's threshold. :mod:`.configmaps` wraps them for Grafana's sidecar on
Kubernetes. (Plotting the panels into PNGs is a repository tool,
tools/grafana_render/, not part of the package.)
"""
