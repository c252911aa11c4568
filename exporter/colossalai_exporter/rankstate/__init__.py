"""The contract between a training rank and the node agent.

* :mod:`.schema`: the snapshot a rank publishes (phases, devices, activity,
  collective progress, errors), its JSON encoding and version.
* :mod:`.files`: where snapshots live and how they are written and read.
* :mod:`.verdict`: stalled or not, healthy or not, judged from a snapshot alone.
* :mod:`.families`: the metric families both sides serve from a snapshot.

``training/`` writes snapshots and ``node/`` reads them; neither imports the other.
"""
