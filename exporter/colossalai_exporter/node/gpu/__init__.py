"""The gpu collector: NVML in a worker process with a deadline.

The public class is :class:`colossalai_exporter.node.gpu.collector.GpuCollector`.
This package's ``__init__`` imports nothing, so that the NVML worker process
(which imports :mod:`.worker` and :mod:`.reader`) stays small and starts fast:
prometheus_client and the catalogue are loaded only by the agent's side.
"""
