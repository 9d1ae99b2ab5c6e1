"""Per generated token: the layer matmuls on one core or on all, chosen from measured step times.

Why: a one-token decode step makes ~100 matmul launches of 0.1-1 M multiply-adds each. On an
idle machine, with the OpenMP workers spinning briefly between launches (GOMP_SPINCOUNT,
kernels/__init__.py), splitting those matmuls over the cores makes the faster step. When another
process holds a core, every parallel launch waits for a descheduled worker and the same step is
about three times slower than on one core. Which arm wins depends on the machine's load at that
moment, which neither a start-up setting nor a fixed threshold knows and which changes while a
chat runs. So the tuner measures: it runs both arms for a few steps, keeps the faster one, watches
its step time, and probes again after `period` steps (the period doubles while the choice holds,
up to `max_period`, and resets when it flips) or sooner when that time moves by more than `drift`
in the direction that can change the answer: slower on the parallel arm (load came: parallel
launches now wait for a descheduled worker), faster on the serial arm (load went). A probe's first
step of the other arm ends it when that step is `drift` slower than the exploited arm: under load
a parallel step can cost 3x a serial one, so a probe should cost one such step. On a jittery
loaded machine step times cross the drift bound by chance, so each such probe that keeps the arm
doubles the steps the next one must wait (`drift_gap`, up to `max_period`); a flip resets it.

The arms differ only in the matmul threshold the step's forward is given (`model.forward(ub, mctx,
min_macs)`, which every matmul of the step takes as its argument; SERIAL: the configured
`kvchat.kernels.parallel.MATMUL_PAR_MIN_MACS`, PARALLEL: `PARALLEL_ARM_MACS`; the step's
attention threshold is the lower of it and the configured one, runtime/arch/layer_plan.Launch, so
on PARALLEL a generated token's attention splits over the threads too); nothing global
changes during a step. Serial and parallel matmul kernels give
bit-identical rows (tests/test_launch_tuner.py), so the choice changes speed, never tokens.
Only generated tokens are tuned: Context.decode_one runs its step through `forward`; decode()
(prompts, batches of several sequences) never asks the tuner and keeps the configured threshold.
A user's KVCHAT_MATMUL_PAR_MIN_MACS turns the tuner off: their threshold holds for every step.
The first step on each arm is not counted (it may load or compile a kernel).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque

from kvchat.kernels import parallel

SERIAL, PARALLEL = 0, 1
ARM_NAMES = ("serial", "parallel")
PARALLEL_ARM_MACS = 0  # threshold during a PARALLEL step: every layer matmul splits over the cores


class LaunchTuner:
    """Chooses SERIAL or PARALLEL for each one-token step (see the module docstring)."""

    def __init__(
        self,
        clock=time.perf_counter,
        *,
        enabled: bool | None = None,
        n_probe: int = 3,
        n_reprobe: int = 2,
        period: int = 32,
        max_period: int = 128,
        drift: float = 1.3,
        margin: float = 0.97,
    ):
        if enabled is None:
            enabled = "KVCHAT_MATMUL_PAR_MIN_MACS" not in os.environ
        self.enabled = enabled
        self.clock = clock
        self.n_probe, self.n_reprobe = n_probe, n_reprobe
        self.base_period, self.max_period = period, max_period
        self.drift, self.margin = drift, margin
        self.arm = SERIAL  # the arm exploited between probes
        self.period = period
        self.warm = [False, False]  # has each arm run once (its first step is not counted)?
        self.probing = self.reprobe = False
        self.plan: list[int] = []  # arms of the probe in progress, next first
        self.probe_times: tuple[list, list] = ([], [])  # seconds per step of this probe, per arm
        self.window: list[float] = []  # the last 3 exploited step times
        self.ref = 0.0  # the exploited arm's median step time when it was chosen
        self.current = 0.0  # its median step time when the probe in progress started
        self.since = 0  # exploited steps since the last probe
        self.drift_gap = 0  # exploited steps before a drift may start a probe (grows on false alarms)
        self.drift_probe = False  # was the probe in progress started by a drift?
        self.history: deque = deque(maxlen=4096)  # (arm, seconds) of the last counted steps (tests, benchmarks)
        self._start_probe(self.n_probe)

    # ---- the hook: Context.decode_one runs each generated token's step through it -----------

    def forward(self, model, ub, mctx):
        """model.forward(ub, mctx) of a generated token, given the matmul threshold of the chosen
        arm (min_macs); a disabled tuner keeps the configured one and times nothing."""
        if not self.enabled:
            return model.forward(ub, mctx)
        arm = self.next_arm()
        t0 = self.clock()
        out = model.forward(ub, mctx, min_macs=self.min_macs(arm))
        self.record(arm, self.clock() - t0)
        return out

    @staticmethod
    def min_macs(arm: int) -> int:
        """The matmul threshold a step of `arm` runs with."""
        configured = parallel.MATMUL_PAR_MIN_MACS
        return configured if arm == SERIAL else min(configured, PARALLEL_ARM_MACS)

    # ---- decisions --------------------------------------------------------------------------

    def next_arm(self) -> int:
        """The arm the next one-token step runs on."""
        return self.plan[0] if self.plan else self.arm

    def record(self, arm: int, seconds: float) -> None:
        """Account one step of `arm` that took `seconds`, and decide what comes next."""
        if self.plan and self.plan[0] == arm:
            self.plan.pop(0)
        if not self.warm[arm]:
            self.warm[arm] = True
            if self.probing:
                self.plan.append(arm)  # this step loaded its kernels: count one more instead
            return
        self.history.append((arm, seconds))
        if self.probing:
            self.probe_times[arm].append(seconds)
            if self.reprobe and arm != self.arm and seconds > self.current * self.drift:
                self.plan = []  # the other arm is clearly worse: one step of it is enough
                self._decide(keep=True)
            elif not self.plan:
                self._decide()
            return
        self.since += 1
        self.window = (self.window + [seconds])[-3:]
        moved = False
        if len(self.window) == 3 and self.since >= self.drift_gap:
            med = statistics.median(self.window)
            moved = med > self.ref * self.drift if self.arm == PARALLEL else med < self.ref / self.drift
        if moved or self.since >= self.period:
            self._start_probe(self.n_reprobe)
            self.drift_probe = moved

    def _start_probe(self, n: int) -> None:
        """Interleave n counted steps of each arm, the one not exploited first."""
        other = 1 - self.arm
        self.plan = [other, self.arm] * n
        self.probe_times = ([], [])
        self.probing = True
        self.reprobe = self.ref > 0  # not the first probe
        # the exploited arm's time now (the window moved if the probe is for drift)
        self.current = statistics.median(self.window) if self.window else self.ref

    def _decide(self, keep: bool = False) -> None:
        if keep:
            best = self.arm
        else:
            ser = statistics.median(self.probe_times[SERIAL])
            par = statistics.median(self.probe_times[PARALLEL])
            best = PARALLEL if par < ser * self.margin else SERIAL
        self.period = min(self.period * 2, self.max_period) if best == self.arm else self.base_period
        if best != self.arm:
            self.drift_gap = 0
        elif self.drift_probe:  # a false alarm: wait longer before the next drift probe
            self.drift_gap = min(max(2 * self.drift_gap, 4), self.max_period)
        self.drift_probe = False
        self.arm = best
        if not keep:
            self.ref = par if best == PARALLEL else ser
        self.window, self.since = [], 0
        self.probing = False
