"""Plot the dashboards' panels from a real Prometheus, the way Grafana would query them.

A repository tool (docs/dashboards/*.png, and the end-to-end test's check that
no panel is empty), not part of the package: :mod:`.jsonmodel` reads a
dashboard's JSON model, :mod:`.interpolate` substitutes Grafana's variables and
built-ins, :mod:`.query` runs the queries, :mod:`.render_png` draws them.
"""
