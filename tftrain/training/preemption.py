"""Preemption: SIGTERM or SIGINT at any moment of a run stops it at the next safe point.

A scheduler sends SIGTERM (SLURM before a job's time limit, Kubernetes before evicting a
pod); a user presses Ctrl-C. Either can arrive during a training batch, validation, a
checkpoint save, between stages or during an export. The handler only sets a flag, so
nothing is interrupted half-way; the run looks at the flag where stopping leaves a
consistent state (after a training batch or an epoch's validation, with a checkpoint
saved; between stages; after the export in progress) and raises `Preempted`, which the
CLI turns into exit code 42, TensorFlow's convention for "restart me". In a cluster every
worker asks at the same points and they agree through one small all-reduce, so all stop
together. A second SIGINT raises KeyboardInterrupt at once, for a user who wants out now.
"""
from __future__ import annotations

import signal
import threading


class Preempted(Exception):
    """Stopped by SIGTERM/SIGINT at a safe point (checkpoint saved when training)."""


class Preemption:
    """The run's stop flag, set by SIGTERM/SIGINT while `installed`."""

    signals = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None      # the signal's name once one arrived
        self._previous: dict = {}

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():   # handlers: main only
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def rearm(self) -> None:
        """Take the signals back: TensorFlow's coordination service (multi-worker) installs
        a SIGTERM handler of its own in C++ when the strategy is built, which would make
        this flag miss the signal. Called after that and before each stage."""
        if self._previous:
            for sig in self.signals:
                signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested == "SIGINT":
            raise KeyboardInterrupt          # the second Ctrl-C: stop without waiting
        self.requested = signal.Signals(signum).name

    def due(self, agree=None) -> bool:
        """Whether to stop now; `agree(flag)` makes every worker of a cluster answer alike."""
        flag = self.requested is not None
        return agree(flag) if agree else flag

    def check(self, where: str, agree=None) -> None:
        """Raise Preempted if a stop was asked for (`where`: what was completed)."""
        if self.due(agree):
            raise Preempted(f"stopped by {self.requested or 'a signal to another worker'} "
                            f"{where}; rerun the same command to resume")
