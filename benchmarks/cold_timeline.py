"""A first-ever `kvchat run` with a timeline of its start-up on stderr: when the workers start, when
the plan is ready, when the weights are loaded, each compile finished (serial set / all), the
answer's first byte, and per planned kernel the wall and CPU seconds of its compile in a worker.

    python benchmarks/cold_timeline.py smollm2|gemma3|MODEL

Empty NUMBA_CACHE_DIR and a KVCHAT_CACHE holding only links to the models (as
benchmarks/cold_start.py does), `run -m MODEL -p Hello -n 16` in this process with the compile
workers on. benchmarks/cold_start.py gives the totals (first byte, exit, RSS); this shows where
the time went. Timestamps are wall seconds since start, with this process's CPU seconds.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

T0 = time.perf_counter()


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.perf_counter() - T0:7.2f}s cpu {time.process_time():6.1f}] {msg}\n")
    sys.stderr.flush()


def fresh_caches() -> None:
    tmp = tempfile.mkdtemp(prefix="kvchat-timeline-")
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(tmp, "numba")
    models = os.path.join(tmp, "kvchat", "models")
    os.makedirs(models)
    for p in (Path.home() / ".cache/kvchat/models").glob("*.gguf"):
        os.symlink(p, os.path.join(models, p.name))
    os.environ["KVCHAT_CACHE"] = os.path.join(tmp, "kvchat")


def instrument() -> list:
    """Wrap CompileAhead.start/_plan and Model.load with log lines; returns the list the started
    CompileAhead lands in."""
    from kvchat.runtime.model import Model
    from kvchat.runtime.startup import compile_ahead as ca

    started: list = []
    start, plan, load = ca.CompileAhead.start, ca.CompileAhead._plan, Model.load.__func__

    def watch(ahead) -> None:
        last = None
        while not ahead.finished:
            now = (ahead.serial_done, ahead.done)
            if now != last:
                last = now
                log(f"compiled: serial set {now[0]}/{ahead.n_serial}, all {now[1]}")
            time.sleep(0.2)
        log(f"all compiled: {ahead.done}")

    def timed_start(self):
        log("workers start")
        started.append(self)
        out = start(self)
        threading.Thread(target=watch, args=(self,), daemon=True).start()
        return out

    def timed_plan(self, worker):
        plan(self, worker)
        log(f"planned: serial set {self.n_serial}, all {len(self.entries or [])}")

    def timed_load(cls, *args, **kwargs):
        log("model load begins")
        model = load(cls, *args, **kwargs)
        log("model loaded")
        return model

    ca.CompileAhead.start, ca.CompileAhead._plan = timed_start, timed_plan
    Model.load = classmethod(timed_load)
    return started


class FirstByte:
    """stdout that logs when the answer's first visible byte is written."""

    def __init__(self, out):
        self.out, self.seen = out, False

    def write(self, s):
        if not self.seen and s.strip():
            self.seen = True
            log(f"first byte {s[:20]!r}")
        return self.out.write(s)

    def __getattr__(self, name):
        return getattr(self.out, name)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    fresh_caches()
    log("start")
    started = instrument()
    sys.stdout = FirstByte(sys.stdout)
    sys.argv = ["kvchat", "run", "-m", model, "-p", "Hello", "-n", "16"]
    from kvchat.cli.app import main as kvchat_main

    try:
        kvchat_main()
    finally:
        log("exit")
        for ahead in started:
            for i, entry in enumerate(ahead.entries or []):
                wall, cpu = ahead.seconds.get(entry, (0.0, 0.0))
                kind = "serial" if i < ahead.n_serial else "rest"
                log(f"  {kind:6s} {i:2d} {entry[0].split('.')[-1]}.{entry[1]}: wall {wall:5.1f} s, CPU {cpu:5.1f} s")


if __name__ == "__main__":
    main()
