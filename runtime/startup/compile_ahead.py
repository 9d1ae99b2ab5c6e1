"""Compile a run's kernels in worker processes, on every core, while the caller does something
else (the chat takes input; `run` loads its model); the caller waits only before it decodes.

numba compiles a kernel in the process that calls it, one kernel at a time (its compiler lock),
so a first run used one core for minutes. Here `CompileAhead(model_path, cparams).start()`
starts `n_workers` processes (kvchat.runtime.startup.compile_worker; default: one per core, at most
2 — MAX_WORKERS) and a thread per worker that drives it:
1. worker 0 *plans*: it opens the model (its weights under the dry run too), makes the Context
   and runs a warm-up decode under kvchat.kernels.compile_plan.dry_run(), which lists the
   (kernel, signature) pairs that decode calls without compiling them; the pairs numba's cache
   already holds are dropped; the serial set (what a first answer runs) comes first;
2. the workers take those pairs from a shared queue, each compiled by
   `Dispatcher.compile(signature)`, which writes numba's on-disk cache (safe with several
   writers: kvchat.kernels.cache_writes). A kernel's parallel and serial twins (`name_par` /
   `name_ser`, `name` / `name_serial` of one module) are one job, compiled in turn by one
   worker: they share their body (a cached kernel both call), which the second then loads
   instead of both workers compiling it at once. Jobs of twins go first (the heavy ones), then
   the known long compiles (COMPILE_SECONDS); in the serial set every entry is a job of its own;
3. the caller's own decode then loads every kernel from the cache; one the plan missed is
   compiled by the caller on its first call, as without workers.
`wait(on_progress)` blocks until the workers are done (Ctrl-C raises KeyboardInterrupt in the
caller and leaves them working); `progress` is (done, total) — total None while planning.
`close()` ends the workers after the kernel each is compiling. A worker whose resident memory
passed WORKER_RSS_LIMIT is replaced by a fresh one before its next kernel (numba keeps all it
compiled), which bounds a first run's peak memory at the cost of a process start.

Workers run in their own session (a Ctrl-C in the terminal is the chat's, not theirs), end when
their input closes, and (Linux) get SIGTERM when the process that started them ends; a chat left
before its kernels were needed kills them (`close(kill=True)`).
"""

from __future__ import annotations

import os
import pickle
import queue
import re
import subprocess
import sys
import threading
import time

MAX_WORKERS = 2  # compiling is CPU-bound: one per core; docs/performance.md has 1 vs 2
WORKERS_ENV = "KVCHAT_COMPILE_WORKERS"  # a user's count (0: no workers, compile in-process)
WORKER_RSS_LIMIT = 400 << 20  # a worker past this many resident bytes is replaced before its next kernel
PLAN_PROMPT = 64  # the warm-up's prompt length: past every parallel threshold (generate.warm_up)


def worker_count() -> int:
    """KVCHAT_COMPILE_WORKERS if set (0 = none), else min(cores, MAX_WORKERS)."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if text.isdigit():
        return int(text)
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


TWIN = re.compile(r"_(par|ser|serial)$")  # a kernel's parallel / serial twin: one job with its sibling

# CPU seconds one compile of these kernels took in a worker (SmolLM2, this machine, session 12:
# benchmarks/cold_timeline.py; docs/performance.md "Cold start"). Only their order matters: the
# serial set's jobs go longest first, so that the longest one does not start last and leave the
# other worker idle while the first answer waits.
COMPILE_SECONDS = {
    "_flash_units": 12.0,
    "_flash_attn_par": 12.0,
    "matmul_q_serial": 7.0,
    "matmul_q": 6.0,
    "_prep_store_tokens": 3.0,
    "_prep_store_par": 3.5,
    "_glu_rows_ser": 1.7,
    "_glu_rows_par": 2.9,
}


def jobs_of(entries: list, twins: bool = True) -> list[list]:
    """The plan's entries as jobs: lists of (index, entry), a kernel's twins together (in plan
    order; twins=False: every entry a job of its own, as in the serial set, which holds no
    parallel twin); jobs of several entries first, then the known long compiles longest first
    (COMPILE_SECONDS), the rest in plan order."""
    groups: dict = {}
    for i, entry in enumerate(entries):
        module, qualname, _ = entry
        groups.setdefault((module, TWIN.sub("", qualname)) if twins else i, []).append((i, entry))

    def longest_first(job):
        return len(job) == 1, -sum(COMPILE_SECONDS.get(entry[1], 0.0) for _, entry in job)

    return sorted(groups.values(), key=longest_first)  # stable: plan order among equals


class _Worker:
    """One compile_worker process and its pickled request/answer channel."""

    def __init__(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvchat.runtime.startup.compile_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if not os.environ.get("KVCHAT_DEBUG") else None,
            env=env,
            start_new_session=True,  # the terminal's Ctrl-C goes to the chat only
        )

    def ask(self, request):
        pickle.dump(request, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.flush()
        return pickle.load(self.proc.stdout)  # EOFError when the worker died

    def close(self, kill: bool = False) -> None:
        try:
            self.proc.stdin.close()  # the worker ends after its current request
        except OSError:
            pass
        if kill and self.proc.poll() is None:
            self.proc.kill()  # now: its current kernel is not saved
            self.proc.wait()
        elif self.proc.poll() is None:  # reaped when it ends (no zombie beside a long chat)
            threading.Thread(target=self.proc.wait, daemon=True, name="compile-worker-reap").start()


class CompileAhead:
    def __init__(self, model_path, cparams, n_workers: int | None = None, n_prompt: int = PLAN_PROMPT):
        self.model_path = str(model_path)
        self.cparams = cparams
        self.n_workers = worker_count() if n_workers is None else n_workers
        self.n_prompt = n_prompt
        self.entries: list | None = None  # the plan's pairs not yet cached: the serial set first
        self.n_serial = 0  # how many of them a first answer needs (kernels.parallel.hold_serial)
        self.done = 0
        self.serial_done = 0
        self.seconds: dict = {}  # entry -> (wall, CPU) seconds of its compile in a worker
        self.plan_seconds = None  # wall seconds until the plan was known
        self.errors: list[str] = []
        self.started_at = None
        self.finished_at = None
        self._jobs: queue.Queue = queue.Queue()
        self._planned = threading.Event()
        self._serial_ready = threading.Event()
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._threads: list[threading.Thread] = []
        self._running = 0
        self._closed = False

    # ---- the caller's side -------------------------------------------------------------------

    def start(self) -> "CompileAhead":
        self.started_at = time.perf_counter()
        if self.n_workers < 1:
            self._finish()
            return self
        for _ in range(self.n_workers):
            try:
                self._workers.append(_Worker())
            except OSError as e:
                self.errors.append(f"cannot start a compile worker: {e}")
        self._running = len(self._workers)
        if not self._workers:
            self._finish()
        for i, worker in enumerate(self._workers):  # the first one plans
            t = threading.Thread(target=self._drive, args=(worker, i == 0), daemon=True, name=f"compile-{i}")
            self._threads.append(t)
            t.start()
        return self

    @property
    def progress(self) -> tuple[int, int | None]:
        """(kernels compiled, kernels to compile); the total is None while the plan is made."""
        return self.done, None if self.entries is None else len(self.entries)

    @property
    def serial_progress(self) -> tuple[int, int | None]:
        """(serial-set kernels compiled, serial-set kernels); the total is None while planning."""
        return self.serial_done, None if self.entries is None else self.n_serial

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def wait(self, on_progress=None, poll: float = 0.1, serial: bool = False) -> None:
        """Block until every worker is done (serial: until the serial set is cached);
        on_progress(done, total) whenever that changes. A KeyboardInterrupt (Ctrl-C) leaves the
        workers compiling."""
        event = self._serial_ready if serial else self._finished
        now = (lambda: self.serial_progress) if serial else (lambda: self.progress)
        last = None
        while not event.wait(poll):
            if on_progress is not None and now() != last:
                last = now()
                on_progress(*last)
        if on_progress is not None and now() != last:
            on_progress(*now())

    def close(self, kill: bool = False) -> None:
        """No more jobs; each worker ends after the kernel it is compiling (kill: at once)."""
        self._closed = True
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._planned.set()
        for w in list(self._workers):
            w.close(kill)

    # ---- the worker threads ------------------------------------------------------------------

    def _drive(self, worker: _Worker, plans: bool) -> None:
        try:
            if plans:
                self._plan(worker)
            else:
                self._planned.wait()
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                for i, entry in job:
                    answer = worker.ask(("compile", i, entry))
                    with self._lock:
                        self.done += 1
                        if i < self.n_serial:
                            self.serial_done += 1
                            if self.serial_done == self.n_serial:
                                self._serial_ready.set()
                        self.seconds[entry] = (answer[2], answer[3])
                        if answer[4]:
                            self.errors.append(answer[4])
                if answer[5] > WORKER_RSS_LIMIT and not self._jobs.empty():
                    worker = self._replace(worker)
        except (
            EOFError,
            OSError,
            ValueError,
            pickle.UnpicklingError,
        ) as e:  # died or closed: the caller compiles the rest
            self.errors.append(f"compile worker ended: {type(e).__name__}")
        finally:
            worker.close()
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if plans:
                self._planned.set()
            if last:
                self._finish()

    def _replace(self, worker: _Worker) -> _Worker:
        """A new worker for an old one grown past WORKER_RSS_LIMIT (numba keeps every module it
        compiled: a first run's peak memory is the largest worker's, not the sum of its kernels)."""
        worker.close()
        fresh = _Worker()
        with self._lock:
            self._workers.append(fresh)
        return fresh

    def _plan(self, worker: _Worker) -> None:
        try:
            answer = worker.ask(("plan", self.model_path, self.cparams, self.n_prompt))
            self.plan_seconds = time.perf_counter() - self.started_at
            if answer[0] == "planned":
                serial, rest = answer[1]
                self.n_serial = len(serial)
                self.entries = serial + rest
                if not serial:
                    self._serial_ready.set()
                if not self._closed:  # the serial set's jobs first: a first answer waits for them only
                    for job in jobs_of(serial, twins=False) + [
                        [(len(serial) + i, e) for i, e in j] for j in jobs_of(rest)
                    ]:
                        self._jobs.put(job)
            else:
                self.entries = []
                self.errors.append(answer[1])
        finally:
            self._planned.set()

    def _finish(self) -> None:
        if self.entries is None:
            self.entries = []
        self.finished_at = time.perf_counter()
        self._serial_ready.set()
        self._finished.set()
