"""TrainingMonitor: a few lines in a training script make every quiet failure visible.

>>> monitor = TrainingMonitor(serve="none", run_dir=None)  # doctest: +SKIP
>>> for batch in loader:                                   # doctest: +SKIP
...     with monitor.step(samples=len(batch)) as step:
...         loss = train_step(batch)
...         step.loss = loss

The monitor is the facade; each job is a module of its own: the options
(settings.py), step accounting, the only code a step runs (steps.py: two clock
reads and plain attribute writes, no lock, I/O, GPU sync or collective), phases
and the blocks that set them (phases.py), when a snapshot is published
(publisher.py), stall evidence (evidence.py), heartbeats, the rank server, and
the ColossalAI hooks (colossal.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.rankstate import files as snapfiles
from colossalai_exporter.rankstate.schema import (
    WAITING,
    Activity,
    Device,
    Interruption,
    Snapshot,
)
from colossalai_exporter.training import activity, flight_recorder
from colossalai_exporter.training import crash as _crash_report
from colossalai_exporter.training import fatal as _fatal_hook
from colossalai_exporter.training.device_loss import DeviceLossReader
from colossalai_exporter.training.errors import error_record
from colossalai_exporter.training.evidence import StallEvidence
from colossalai_exporter.training.heartbeat import HeartbeatSender
from colossalai_exporter.training.oom import classify_oom
from colossalai_exporter.training.phases import Phases
from colossalai_exporter.training.publisher import Publisher
from colossalai_exporter.training.settings import MonitorSettings
from colossalai_exporter.training.signals import RECORD_WAIT_SECONDS, SignalRecorder
from colossalai_exporter.training.state import Budgets, RankState
from colossalai_exporter.training.steps import Step, StepCounter
from colossalai_exporter.training.unannounced import UnannouncedWork

log = logging.getLogger("colossalai_exporter.training")

_wall = time.time


def _process_start(pid: int) -> float | None:
    # Lets the node agent tell this process from a later one that reuses the pid.
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:
        return None


class TrainingMonitor:
    """Steps, phases, out-of-memory errors, checkpoints and Gemini state of one rank.

    Construction starts (unless ``start=False``) the publisher thread (snapshots
    into ``run_dir``, stall detection), the heartbeat sender when a heartbeat
    URL is set, and the HTTP server (``/metrics``, ``/health``) on the ranks
    ``serve`` selects. Nothing here ever raises into training: a port in use,
    an unwritable run directory or a bad heartbeat URL is one warning.

    Arguments (keyword only; the environment fills in what is not given):

    * ``rank``, ``local_rank``, ``world_size``: default to torch.distributed when
      initialised, else ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``.
    * ``serve``: ``"rank0"`` (default), ``"local"`` (every rank, on ``port`` +
      local rank) or ``"none"``; ``COLOSSALAI_EXPORTER_SERVE``.
    * ``port`` (8766, ``COLOSSALAI_EXPORTER_PORT``), ``host`` ("0.0.0.0": Prometheus
      scrapes it from another host, as every exporter; ``COLOSSALAI_EXPORTER_HOST``).
    * ``web_config``: the exporter web config file (TLS, client certificates, bcrypt
      basic auth) that the node agent, prober and bridge take with
      ``--web.config.file`` (``COLOSSALAI_EXPORTER_WEB_CONFIG``); a file that cannot
      be read or is invalid means no server, with a warning (never an open one).
    * ``run_dir``: snapshot directory (``COLOSSALAI_EXPORTER_RUN_DIR``, default
      ``/dev/shm/colossalai-exporter``); ``None`` disables snapshots.
    * ``budgets`` or the shortcuts ``step_timeout`` (fixes the learned step budget),
      ``startup_timeout``, ``checkpoint_timeout``.
    * ``step_heartbeat_url`` / ``checkpoint_heartbeat_url`` (``STEP_HEARTBEAT_URL``,
      ``CHECKPOINT_HEARTBEAT_URL``), sent from rank 0 only unless
      ``heartbeat_all_ranks``; ``heartbeat_every`` steps (50).
    * ``nvme_paths``: offload directories (``NVME_PATH``) for OOM classification.
    * ``loss_from_device``: True reads accelerator loss tensors with ``.item()`` at
      publish time (one device synchronisation per publish); by default a CUDA
      loss is copied to the host asynchronously (:mod:`.device_loss`).
    * ``run_id``: the ``run`` label on ``colossalai_training_info`` that alerts of
      one job share (see :func:`~colossalai_exporter.training.settings.detect_run_id`).
    * ``watch_kernels``: watch ColossalAI's ``KernelLoader.load`` as phase
      ``kernels`` (default True; see :meth:`kernels`).
    * ``record_signals``: record SIGTERM and SIGINT in the snapshot before they take
      effect (default True; :mod:`.signals`), so that a preempted or cancelled rank,
      and a rank torchrun stops after another failed, is not paged as a crash.
    """

    def __init__(
        self,
        *,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        serve: str | None = None,
        port: int | None = None,
        host: str | None = None,
        web_config: str | os.PathLike[str] | None = None,
        run_dir: str | os.PathLike[str] | bool | None = True,
        budgets: Budgets | None = None,
        step_timeout: float | None = None,
        startup_timeout: float | None = None,
        checkpoint_timeout: float | None = None,
        publish_interval: float = 1.0,
        step_heartbeat_url: str | None = None,
        checkpoint_heartbeat_url: str | None = None,
        heartbeat_every: int = 50,
        heartbeat_timeout: float = 5.0,
        heartbeat_all_ranks: bool = False,
        nvme_paths: tuple[str, ...] | None = None,
        loss_from_device: bool | None = None,
        run_id: str | None = None,
        watch_kernels: bool = True,
        record_signals: bool = True,
        start: bool = True,
    ) -> None:
        self.settings = settings = MonitorSettings.resolve(
            rank=rank, local_rank=local_rank, world_size=world_size, serve=serve, port=port,
            host=host, web_config=web_config, run_dir=run_dir, budgets=budgets,
            step_timeout=step_timeout, startup_timeout=startup_timeout,
            checkpoint_timeout=checkpoint_timeout, publish_interval=publish_interval,
            step_heartbeat_url=step_heartbeat_url,
            checkpoint_heartbeat_url=checkpoint_heartbeat_url, heartbeat_every=heartbeat_every,
            heartbeat_timeout=heartbeat_timeout, heartbeat_all_ranks=heartbeat_all_ranks,
            nvme_paths=nvme_paths, loss_from_device=loss_from_device, run_id=run_id,
            watch_kernels=watch_kernels, record_signals=record_signals)
        self.rank, self.local_rank = settings.rank, settings.local_rank
        self.world_size, self.budgets = settings.world_size, settings.budgets
        self.run_id = settings.run_id
        #: None once the run directory proved unwritable (start())
        self.run_dir: Path | None = settings.run_dir
        pid = os.getpid()
        self._state = RankState(self.rank, self.local_rank, self.world_size, pid,
                                _process_start(pid), pid_ns=snapfiles.pid_namespace())
        self._loss_reader = DeviceLossReader(synchronous=settings.loss_from_device)
        self._last_loss_ref: Any = None
        self._signals = SignalRecorder(self._interrupted) if settings.record_signals else None
        self._publisher = Publisher(self._publish, settings.publish_interval)
        self._steps = StepCounter(self._state, start_training=lambda: self.phase("training"),
                                  raised=self._step_raised)
        self._reported: set[str] = set()
        self._was_stalled = False
        # The thread that trains: the main thread, as in every launcher's script
        # (torchrun, colossalai run). Sampled, never touched (training/activity.py).
        self._training_thread = threading.main_thread().ident
        self._server: Any = None
        self._pollers: list[Callable[[RankState], None]] = []
        # the flight recorder's groups, kept between reads: naming them is costly
        self._progress = flight_recorder.ProgressReader()
        self._pending = flight_recorder.PendingReader()
        self._evidence = StallEvidence(self.rank, self._error)
        self._heartbeats = HeartbeatSender(
            self._state, settings.step_heartbeat_url, settings.checkpoint_heartbeat_url,
            every=settings.heartbeat_every, timeout=settings.heartbeat_timeout,
            on_error=self._error)
        self._phases = Phases(self._state, self._publisher,
                              record_exception=self._record_exception, error=self._error,
                              checkpoint_done=self._heartbeats.checkpoint_done)
        self._unannounced = UnannouncedWork(self._state, self._steps, self._phases,
                                            self.budgets, self._training_thread)
        self._info_defaults()
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the publisher, heartbeat sender and server (idempotent)."""
        if self._publisher.started:
            return
        if self.run_dir is not None:
            try:
                snapfiles.prepare_run_dir(self.run_dir)
            except OSError as exc:
                log.warning("run directory %s is not writable (%s); rank snapshots and "
                            "stall evidence are disabled, training continues",
                            self.run_dir, exc.strerror or exc)
                self._count_error("publish")
                self.run_dir = None
        self._publisher.start()
        self._heartbeats.start()
        self._start_server()
        _fatal_hook.attach(self)
        if self.run_dir is not None:
            # a crash in native code leaves its report for the node agent (rankstate/crash.py)
            _crash_report.install(self, self.run_dir, self.rank, self._training_thread)
        if self._signals is not None and not self._signals.install():
            log.info("rank %d: the monitor was started outside the main thread; SIGTERM "
                     "and SIGINT are not recorded", self.rank)
        if self.settings.watch_kernels:
            from colossalai_exporter.training import colossal

            try:
                colossal.watch_kernel_loader(self)
            except Exception as exc:
                self._error("hook", exc)

    def _start_server(self) -> None:
        settings = self.settings
        if not settings.serves:
            return
        try:
            from colossalai_exporter.training.server import build_app
            from colossalai_exporter.web import load_web_config, serve

            web_config = load_web_config(settings.web_config)
            self._server = serve(build_app(self.snapshot, web_config=web_config),
                                 f"{settings.host}:{settings.server_port}", web_config,
                                 name="training",
                                 option="TrainingMonitor(port=…, host=…) / "
                                        "COLOSSALAI_EXPORTER_PORT")
        except ConfigError as exc:
            log.warning("rank %d cannot serve /metrics and /health: %s (or serve='none'); "
                        "training continues", self.rank, exc)
            self._count_error("server")
            return
        except Exception as exc:
            self._error("server", exc)
            return
        log.info("rank %d serves /metrics and /health on %s; snapshots in %s", self.rank,
                 self._server.url, self.run_dir or "(none)")

    @property
    def url(self) -> str | None:
        """Base URL of this rank's server, or None when it serves nothing."""
        return None if self._server is None else str(self._server.url)

    def close(self) -> None:
        """Publish a last snapshot, stop the threads and the server."""
        _fatal_hook.detach(self)
        _crash_report.uninstall(self)
        if self._signals is not None:
            self._signals.uninstall()
        if self.settings.watch_kernels:
            from colossalai_exporter.training import colossal

            colossal.unwatch_kernel_loader(self)
        self._publisher.stop()
        self._heartbeats.stop()
        # The last snapshot before the server goes: whoever sees rank 0's server gone
        # (the node agent, the demo) can already read why, "finished" or "failed".
        self._publisher.publish()
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> TrainingMonitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.finish()
        elif isinstance(exc, Exception):
            self.fail(exc)
        self.close()

    # ------------------------------------------------------------------ hot path
    def step(self, samples: int = 0, tokens: int = 0) -> Step:
        """A context manager timing one step; see :class:`~.steps.Step`."""
        return self._steps.step(samples, tokens)

    def step_done(self, duration: float | None = None, *, samples: int = 0, tokens: int = 0,
                  loss: Any = None) -> None:
        """Record a finished step, for loops that cannot use ``with monitor.step()``.

        Without ``duration``, the step lasted since the previous ``step_done()``
        (or since training started, for the first).
        """
        self._steps.step_done(duration, samples, tokens, loss)

    # ------------------------------------------------------------------ phases
    def phase(self, name: str) -> None:
        """Enter phase ``name`` (init, kernels, training, checkpointing, evaluating …)."""
        self._phases.enter(name)

    def kernels(self) -> AbstractContextManager[None]:
        """Phase "kernels" around loading or JIT-building kernels, with its own budget.

        ColossalAI's ``KernelLoader.load`` is watched this way by itself once
        the monitor starts (``watch_kernels``), so a JIT build inside
        ``HybridAdam(...)`` shows as phase ``kernels``. An exception leaving the
        block counts in ``colossalai_kernel_build_failures_total``, becomes the
        rank's last error, and the rank returns to its previous phase (the
        caller may fall back to another implementation); if nothing catches
        it, the run fails with it. Nested blocks count once.
        """
        return self._phases.kernels()

    def kernels_ready(self, ready: bool = True) -> None:
        """Declare the run's kernels loaded (or not); /health needs them ready."""
        self._state.kernels_ready = ready
        self._publisher.wake()

    def evaluation(self) -> AbstractContextManager[None]:
        """Phase "evaluating" for the block, then back to training."""
        return self._phases.evaluation()

    def checkpoint(self, step: int | None = None,
                   path: str | os.PathLike[str] | None = None
                   ) -> AbstractContextManager[None]:
        """Phase "checkpointing" for the block; success records time, step and duration.

        Nested use (a watched booster's save inside this block) counts once.
        ``path``, where the checkpoint goes (a watched booster's save passes its
        own), lets a failure say whether that filesystem is full: torch's writer
        reports a full disk as "[enforce fail at inline_container.cc:672] .
        unexpected pos 832 vs 726", with no errno left to read.
        """
        return self._phases.checkpoint(step, path)

    def finish(self) -> None:
        """The run completed: phase "finished" (its snapshot says so to the node agent)."""
        self._phases.finish()

    def fail(self, exc: BaseException | str | None = None) -> None:
        """The run failed: phase "failed" with the reason; OOMs in ``exc`` are counted."""
        self._phases.fail(exc)

    def _exiting(self) -> None:
        """The interpreter exits normally (training/fatal.py) with the run neither finished
        nor failed: the script ended without ``finish()``. An error recorded after the last
        completed step is what ended it (caught, then ``sys.exit(1)``): the run failed of
        it. Otherwise it finished, marked as ended by the exit: a rank whose loop ran out
        of data before the others' is named by what they were left doing (docs/rules.md).
        Not after a signal: the rank recorded that (training/signals.py)."""
        state = self._state
        if os.getpid() != state.pid:
            return  # a forked child (a helper of the rank's) exiting: not the rank
        if state.phase in ("finished", "failed") or state.interruption is not None:
            return
        error = state.last_error
        if error is not None and (state.last_step is None or error.time >= state.last_step):
            self._phases.fail(f"{error.type}: {error.message}")
            return
        state.finished_at_exit = True
        self._phases.finish()

    def _interrupted(self, name: str) -> None:
        """SIGTERM or SIGINT arrived (training/signals.py): say so before it ends the rank."""
        state = self._state
        state.interruption = Interruption(signal=name, time=_wall(), steps=state.steps)
        # The signal ends the rank once this returns: the record must be on disk by then.
        self._publisher.publish_now(wait=RECORD_WAIT_SECONDS)

    # ------------------------------------------------------------------ ColossalAI
    def watch(self, booster: Any, model: Any = None) -> None:
        """Watch a ColossalAI Booster: plugin info, its saves as checkpoints, async saves.

        Pass the boosted ``model`` too (or use :meth:`boost`) to hook Gemini.
        """
        from colossalai_exporter.training import colossal

        if model is not None:
            self._unannounced.model = model
        try:
            colossal.watch_booster(self, booster)
            if model is not None:
                colossal.hook_gemini(self, model)
        except Exception as exc:
            self._error("hook", exc)

    def boost(self, booster: Any, *args: Any, **kwargs: Any) -> Any:
        """``booster.boost(model, optimizer, criterion, dataloader, lr_scheduler)``, watched.

        Returns what ``booster.boost`` returns; exceptions from it pass through
        unchanged after out-of-memory classification.
        """
        from colossalai_exporter.training import colossal

        self.watch(booster)
        try:
            result = booster.boost(*args, **kwargs)
        except BaseException as exc:
            self._record_exception(exc, "boost")
            raise
        if isinstance(result, (tuple, list)) and result:
            self._unannounced.model = result[0]
        try:
            if isinstance(result, (tuple, list)) and result:
                colossal.hook_gemini(self, result[0])
        except Exception as exc:
            self._error("hook", exc)
        return result

    # ------------------------------------------------------------------ errors
    def record_oom(self, exc: BaseException) -> Device | None:
        """Count ``exc`` if it is an out-of-memory error; returns its device or None.

        For an out-of-memory error caught outside the monitored blocks; it also
        becomes the rank's last error (``where="caught"``).
        """
        device = self._classify(exc)
        if device is not None:
            self._record_exception(exc, "caught")
        return device

    def _classify(self, exc: BaseException) -> Device | None:
        try:
            return classify_oom(exc, self.settings.nvme_paths)
        except Exception as error:
            self._error("hook", error)
            return None

    def _record_exception(self, exc: BaseException, where: str, publish: bool = True,
                          note: str = "") -> None:
        """Count ``exc`` (OOMs by device), make it the last error, and publish at once.

        An exception passes through step(), checkpoint() and fail(): counted once.
        The snapshot is written here, before the exception propagates, because
        an out-of-memory error usually ends the process a moment later and the
        node agent must still see it (issue 16: the rank-0 server's scrape saw
        the counter rise in 1 run of 6). Exceptions are rare; the hot path never
        gets here.
        """
        if getattr(exc, "_colossalai_exporter_counted", False):
            return
        with contextlib.suppress(Exception):  # some exception types refuse attributes
            exc._colossalai_exporter_counted = True  # type: ignore[attr-defined]
        device = self._classify(exc)
        state = self._state
        now = _wall()
        if device is not None:
            state.oom[device] += 1
            state.oom_last[device] = now
        state.last_error = error_record(exc, where, device, now, note)
        if publish:
            self._publisher.publish_now()

    def _step_raised(self, exc: BaseException) -> None:
        try:
            self._record_exception(exc, "step")
        except Exception as error:  # the user's exception must still propagate unchanged
            self._error("hook", error)

    def _count_error(self, where: str) -> None:
        errors = self._state.monitor_errors
        errors[where] = errors.get(where, 0) + 1

    def _error(self, where: str, error: BaseException | str) -> None:
        """Count a monitor failure and log it the first time for ``where``."""
        self._count_error(where)
        if where not in self._reported:
            self._reported.add(where)
            log.warning("monitoring problem (%s): %s; training continues", where,
                        error if isinstance(error, str) else f"{type(error).__name__}: {error}")

    # ------------------------------------------------------------------ publishing
    def add_poller(self, poller: Callable[[RankState], None]) -> None:
        """Run ``poller(state)`` in the publisher thread before every snapshot.

        Integrations use it to copy cheap Python-level values (Gemini chunk
        memory, pending async checkpoint writers) into the state. It must not
        touch device tensors or run collectives.
        """
        self._pollers.append(poller)

    def set_info(self, **labels: Any) -> None:
        """Add or replace labels of ``colossalai_training_info``."""
        self._state.info.update({k: str(v) for k, v in labels.items() if v is not None})

    def _info_defaults(self) -> None:
        info: dict[str, Any] = {"world_size": self.world_size, "run": self.run_id}
        torch = sys.modules.get("torch")
        if torch is not None:
            info["torch_version"] = getattr(torch, "__version__", "")
        colossalai = sys.modules.get("colossalai")
        if colossalai is not None:
            info["colossalai_version"] = getattr(colossalai, "__version__", "")
        self.set_info(**info)

    def _refresh(self, where: Activity | None) -> None:
        """The state's polled parts, before a publish; ``where``: the publish's one sample
        of the training thread."""
        state = self._state
        ref = self._steps.loss_ref
        if ref is not None and ref is not self._last_loss_ref:
            self._last_loss_ref = ref
            try:
                self._loss_reader.submit(ref)
            except (TypeError, ValueError, RuntimeError) as exc:
                self._error("loss", f"loss not recorded: {exc}")
        try:
            value = self._loss_reader.poll()
        except (TypeError, ValueError, RuntimeError) as exc:
            self._error("loss", f"loss not recorded: {exc}")
        else:
            if value is not None:
                state.loss = value
        for poller in list(self._pollers):
            try:
                poller(state)
            except Exception as exc:
                self._error("hook", exc)
        try:
            self._unannounced.check(where)
        except Exception as exc:  # a model whose `training` raises: leave the phase be
            self._error("hook", exc)

    def _where(self) -> Activity | None:
        # From the publisher (or a scrape's) thread; a few microseconds, nothing on the
        # training thread. Where a stalled rank is names the rank a hang waits for.
        try:
            return activity.sample(self._training_thread)
        except Exception as exc:
            self._error("stacks", exc)
            return None

    def _sample_activity(self, snap: Snapshot, where: Activity | None) -> None:
        snap.publish_interval = self.settings.publish_interval
        snap.rendezvous = self.settings.rendezvous
        snap.activity = where
        try:
            # The oldest collective in flight, and since when: the agent tells a rank that
            # NCCL's watchdog ended (past its group's timeout) from one killed. Every
            # snapshot, stalled or not: a group's timeout can be shorter than the budget.
            snap.pending = self._pending.read(snap.written)
            snap.in_flight_known = self._pending.readable
            if (snap.pending is not None and not self._pending.ordered
                    and where is not None and where.kind not in WAITING):
                # A completion noted out of order (PendingReader.ordered): a rank out of
                # any wait, its collective returned, is no rank that waits. Read as one,
                # a frozen culprit passed for a waiting rank and was named by no rule.
                snap.pending = None
        except Exception as exc:
            self._error("stacks", exc)
        if snap.stalled:
            # Which collective each process group last enqueued: the rank behind is
            # the one the others wait for. Only while stalled: about 10 us a publish after
            # the stall's first read (up to 0.14 s with torch's buffer full).
            try:
                snap.collectives = self._progress.read()
            except Exception as exc:
                self._error("stacks", exc)

    def _count_activity(self, snap: Snapshot) -> None:
        # The publisher's regular samples while training, counted: the share a rank
        # spends waiting for the others names a straggler in a synchronous job, where
        # every rank steps at the slowest one's rate (TrainingStraggler, cause waits_least).
        where = snap.activity
        if where is None or snap.phase != "training":
            return
        state = self._state
        state.activity_samples += 1
        if where.kind in WAITING:
            state.waiting_samples += 1
        snap.activity_samples = state.activity_samples
        snap.waiting_samples = state.waiting_samples

    @property
    def evidence_files(self) -> list[Path]:
        """The stall evidence written so far (stacks, flight recorder dumps)."""
        return self._evidence.files

    def snapshot(self) -> Snapshot:
        """The rank's current state, as snapshot files and /metrics carry it: the one way
        both are built (a scrape of rank 0's server and the publisher alike)."""
        return self._snapshot(self._where())

    def _snapshot(self, where: Activity | None) -> Snapshot:
        """snapshot() with the training thread's place already sampled (``where``)."""
        if where is not None:
            # before the judgement: a wait that just ended is progress (note_place)
            self._state.note_place(where.kind in WAITING)
        snap = self._state.snapshot(self.budgets)
        if snap.phase == "training":
            self._steps.cap = snap.timeout
        self._sample_activity(snap, where)
        # A stall is counted when first seen, by whichever looks first (the publisher
        # records it in the state when it writes the evidence, below).
        if snap.stalled and not self._was_stalled:
            snap.stalls += 1
        return snap

    def _publish(self, periodic: bool) -> None:
        """One publish (training/publisher.py says when): the snapshot into the run
        directory, and the stall evidence the first time a stall is seen."""
        try:
            # One sample of the training thread a publish, for the unannounced work's
            # check and for the snapshot alike.
            where = self._where()
            self._refresh(where)
            snap = self._snapshot(where)
            if periodic:
                self._count_activity(snap)
            if snap.stalled and not self._was_stalled:
                self._state.stalls += 1
                self._evidence.write(self.run_dir, snap.reason)
            self._was_stalled = snap.stalled
            if self.run_dir is not None:
                snapfiles.write_snapshot(self.run_dir, snap)
        except Exception as exc:
            self._error("publish", exc)
