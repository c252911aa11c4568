"""``colossalai-exporter demo``: a short real training run with the monitor and the node agent.

``cli`` orchestrates (agent, ranks, the live summary), ``launch`` starts the
processes, ``worker`` is the training loop each rank runs, and ``summary``
turns rank snapshots and /health answers into the lines a user reads.
"""
