"""ColossalAI integration: the Booster's plugin and checkpoints, Gemini's memory traffic.

Only Python attributes are read, from the publisher thread or inside hooks the
training thread calls anyway; nothing here touches a CUDA tensor from another
thread or runs a collective (FACTS.md: ``chunk_manager.overflow_counter`` is
a CUDA tensor and ``should_skip_step()`` all-reduces; neither is used).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any

from colossalai_exporter.training.state import RankState

if TYPE_CHECKING:
    from colossalai_exporter.training.monitor import TrainingMonitor

SAVE_METHODS = ("save_model", "save_optimizer", "save_lr_scheduler")
_WATCHED = "_colossalai_exporter_watched"


def plugin_info(plugin: Any, world_size: int | None = None) -> dict[str, Any]:
    """Info labels from a Booster plugin: its class, parallel sizes, the rank's pipeline
    stage, Gemini placement.

    Plugins that only shard data (TorchDDPPlugin, TorchFSDPPlugin, LowLevelZeroPlugin,
    GeminiPlugin without tensor parallelism) have no ``dp_size`` attribute: every
    rank is then a data-parallel replica, so the data-parallel size is the world
    size over the tensor- and pipeline-parallel sizes (1 unless the plugin says).
    """
    if plugin is None:
        return {"plugin": "none"}
    info: dict[str, Any] = {"plugin": type(plugin).__name__}
    for key in ("tp_size", "pp_size", "dp_size"):
        value = getattr(plugin, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            info[key] = value
    if "dp_size" not in info and world_size:
        model_parallel = int(info.get("tp_size", 1)) * int(info.get("pp_size", 1))
        if model_parallel > 0 and world_size % model_parallel == 0:
            info["dp_size"] = world_size // model_parallel
            info.setdefault("tp_size", 1)
            info.setdefault("pp_size", 1)
    # The rank's pipeline stage (HybridParallelPlugin and MoeHybridParallelPlugin with
    # pp_size > 1): TrainingStraggler compares a rank with the ranks of its own stage,
    # since stages do different work.
    stage = getattr(getattr(plugin, "stage_manager", None), "stage", None)
    if isinstance(stage, int) and not isinstance(stage, bool):
        info["pipeline_stage"] = stage
    gemini_config = getattr(plugin, "gemini_config", None)
    if isinstance(gemini_config, dict) and gemini_config.get("placement_policy"):
        info["placement_policy"] = gemini_config["placement_policy"]
    return info


def watch_booster(monitor: TrainingMonitor, booster: Any) -> None:
    """Record the plugin in the info metric; monitor the Booster's saves as checkpoints.

    ``booster.save_model`` / ``save_optimizer`` / ``save_lr_scheduler`` run
    inside :meth:`TrainingMonitor.checkpoint` (nested inside a user's own
    ``with monitor.checkpoint()`` they count once). An async save
    (``use_async=True``) stays "in flight" while the checkpoint IO holds its
    writers: ColossalAI finishes them at the start of the next save or at exit.
    """
    if getattr(booster, _WATCHED, None) is monitor:
        return
    info = plugin_info(getattr(booster, "plugin", None), monitor.world_size)
    colossalai = sys.modules.get("colossalai")
    if colossalai is not None:
        info["colossalai_version"] = getattr(colossalai, "__version__", "")
    monitor.set_info(**info)
    for name in SAVE_METHODS:
        original = getattr(booster, name, None)
        if callable(original):
            setattr(booster, name, _checkpointed(monitor, original))

    def pending_writers(state: RankState) -> None:
        writers = getattr(getattr(booster, "checkpoint_io", None), "async_writers", None)
        state.async_writers = len(writers) if writers is not None else 0

    monitor.add_poller(pending_writers)
    setattr(booster, _WATCHED, monitor)


def _checkpointed(monitor: TrainingMonitor, save: Any) -> Any:
    @functools.wraps(save)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Booster.save_model(model, checkpoint, …): the second argument is where it goes.
        target = kwargs.get("checkpoint", args[1] if len(args) > 1 else None)
        path = target if isinstance(target, (str, os.PathLike)) else None
        with monitor.checkpoint(path=path):
            return save(*args, **kwargs)

    return wrapper


def hook_gemini(monitor: TrainingMonitor, model: Any) -> bool:
    """Capture Gemini's per-iteration traffic and chunk memory; False if not Gemini.

    ``GeminiManager`` keeps ``_h2d_volume`` / ``_d2h_volume`` (bytes) for the
    current iteration and ``post_iter()`` zeroes them at the end of every
    backward, so they are added to running totals inside ``post_iter`` (on the
    training thread, two attribute reads). ``chunk_manager.total_mem`` is a
    dict of Python ints, copied by the publisher thread.
    """
    manager = getattr(model, "gemini_manager", None)
    chunk_manager = getattr(model, "chunk_manager", None)
    if manager is None or not callable(getattr(manager, "post_iter", None)):
        return False
    if getattr(manager, _WATCHED, False):
        return True
    state = monitor._state
    original = manager.post_iter

    @functools.wraps(original)
    def post_iter(*args: Any, **kwargs: Any) -> Any:
        try:
            state.h2d_bytes += float(getattr(manager, "_h2d_volume", 0) or 0)
            state.d2h_bytes += float(getattr(manager, "_d2h_volume", 0) or 0)
        except Exception as exc:
            monitor._error("hook", exc)
        return original(*args, **kwargs)

    manager.post_iter = post_iter
    setattr(manager, _WATCHED, True)
    state.gemini_chunk_memory = {}
    policy = getattr(manager, "policy_name", None)
    if policy:
        monitor.set_info(placement_policy=policy)

    def chunk_memory(state: RankState) -> None:
        total = getattr(chunk_manager, "total_mem", None)
        if isinstance(total, dict):
            state.gemini_chunk_memory = {str(k): float(v) for k, v in dict(total).items()}

    monitor.add_poller(chunk_memory)
    return True


# The monitor that KernelLoader.load reports to: the latest started in this process
# (one per rank in practice). The patch stays in place once made; with no monitor
# it calls the original load directly.
_kernel_monitors: list[TrainingMonitor] = []
_KERNEL_LOADER = "colossalai.kernel.kernel_loader"


def watch_kernel_loader(monitor: TrainingMonitor) -> bool:
    """Report ColossalAI's kernel loads and JIT builds as phase ``kernels``.

    Every loader (``CPUAdamLoader``, ``FusedOptimizerLoader``, the
    flash-attention loaders…) inherits ``KernelLoader.load``, which picks an
    extension and loads the prebuilt kernel or JIT-builds it: 139 s inside
    ``HybridAdam(...)`` on an H200 node (FACTS.md). Wrapping that one method
    in :meth:`TrainingMonitor.kernels` makes the build visible with its own
    budget, and a build that raises (``AssertionError: No usable kernel
    found…``, ``Error building extension``) a counted failure. Only when the
    training script imported ColossalAI; False otherwise.
    """
    if "colossalai" not in sys.modules:
        return False
    module = sys.modules.get(_KERNEL_LOADER)
    if module is None:
        import importlib

        module = importlib.import_module(_KERNEL_LOADER)
    loader = getattr(module, "KernelLoader", None)
    load = getattr(loader, "load", None)
    if loader is None or not callable(load):
        return False
    if monitor not in _kernel_monitors:
        _kernel_monitors.append(monitor)
    if getattr(load, _WATCHED, False):
        return True

    @functools.wraps(load)
    def watched_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        current = _kernel_monitors[-1] if _kernel_monitors else None
        if current is None:
            return load(self, *args, **kwargs)
        with current.kernels():
            return load(self, *args, **kwargs)

    setattr(watched_load, _WATCHED, True)
    loader.load = watched_load
    return True


def unwatch_kernel_loader(monitor: TrainingMonitor) -> None:
    if monitor in _kernel_monitors:
        _kernel_monitors.remove(monitor)
