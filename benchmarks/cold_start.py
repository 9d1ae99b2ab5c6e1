"""A first-ever `kvchat run`: empty kernel cache, fresh process; wall time to the first answer byte,
total wall, CPU, peak RSS, and which kernels the compile time goes to.

    nice python benchmarks/cold_start.py -m smollm2 -m gemma3 [--tree TREE] [--warm] [-- run ARGS]

For each model one child process runs `kvchat run -m MODEL -p Hello -n 16` (or the ARGS after
`--`, MODEL put in for `{model}`) with
- NUMBA_CACHE_DIR a new empty folder: every kernel compiles, as on a fresh install, a kvchat or
  numba upgrade (numba keys its cache on the source and its version);
- KVCHAT_CACHE a new folder holding only links to the model files (as after `kvchat pull`): no
  weight pack, warm-up record, prompt cache or history from earlier runs (`--no-weight-cache`:
  KVCHAT_WEIGHT_CACHE=0 instead, the user's cache folder);
- stdout on a pipe: "first byte" is when the answer's first byte arrives, "exit" when the process
  ends; CPU is the child's user + system time and "peak RSS" its ru_maxrss (both from wait4, so
  they include worker processes it waited for); "tree RSS" the largest sum of RSS over the child
  and its descendants, sampled every 50 ms, and "tree PSS" the largest sum of their Pss (every 0.5 s; each
  shared page — libLLVM, numpy, the model file's — divided among the processes mapping it: the
  tree's physical memory, which the RSS sum overstates by the shared pages counted per process).
The child runs the CLI in-process (`kvchat.cli.app.main`) with a listener on numba's
"numba:compile" events: per dispatcher the CPU seconds of its compiles (exclusive: the time of kernels
it compiled inside is theirs, inline="always" callees and @overload/@intrinsic bodies are their
caller's), the cache write after each, and how many signatures it compiled. The first compile of
a process also pays numba's one-time compiler set-up (target and lowering registries): it shows in
the first kernel's row. The table needs every compile in that process, so the child runs with
KVCHAT_COMPILE_WORKERS=0 (no compile workers: kvchat.runtime.startup.compile_ahead). `--plain` runs
`python -c "from kvchat.cli.app import main; main()"` instead, with the user's default workers
(no listener, no table: the timing a user sees); the workers' CPU is in its CPU column.

`--warm` runs the same command again on the same caches (the second run a user makes).
`--tree TREE` measures that kvchat tree (benchmarks/tree_env.py). `--top N` rows (default 15).
`--json FILE` writes everything measured. `--keep-cache DIR`: the run's numba cache goes to
DIR/numba (which must not exist yet) and stays, e.g. for warm benchmarks of the same tree after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tree_env import ENTRY, check_tree, tree_env  # noqa: E402

MODELS = {
    "smollm2": Path.home() / ".cache/kvchat/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": Path.home() / ".cache/kvchat/models/gemma-3-270m-q4_k_m.gguf",
}


# ---- the child: the CLI in-process, numba's compile events recorded -------------------------


def child(out_path: str, args: list[str]) -> None:
    from numba.core import caching
    from numba.core import event as ev

    rows: dict = {}  # "module.qualname" -> {"seconds", "save", "sigs"}
    stack: list = []  # [name, start, seconds spent in nested compiles]
    clock = time.process_time  # CPU seconds: a compile is one thread's work, and on a shared
    t_start = clock()  # machine its wall time says more about the other processes than about it

    class Listener(ev.Listener):
        def on_start(self, event):
            d = event.data["dispatcher"]
            name = f"{d.py_func.__module__}.{d.py_func.__qualname__}"
            stack.append([name, clock(), 0.0, event.data["args"]])

        def on_end(self, event):
            name, t0, nested, sig = stack.pop()
            total = clock() - t0
            if stack:
                stack[-1][2] += total
            r = rows.setdefault(name, {"seconds": 0.0, "save": 0.0, "sigs": [], "first_at": t0 - t_start})
            r["seconds"] += total - nested
            r["sigs"].append(str(sig))

    numba_save = caching.Cache.save_overload

    def save_overload(self, sig, data):  # after the compile event; its time is the kernel's
        t = clock()
        try:
            return numba_save(self, sig, data)
        finally:
            dt = clock() - t
            name = f"{self._py_func.__module__}.{self._py_func.__qualname__}"
            rows.setdefault(name, {"seconds": 0.0, "save": 0.0, "sigs": [], "first_at": 0.0})["save"] += dt
            if stack:
                stack[-1][2] += dt

    caching.Cache.save_overload = save_overload
    ev.register("numba:compile", Listener())

    def dump():
        with open(out_path, "w") as f:
            json.dump({"kernels": rows, "cpu_in_child": clock() - t_start}, f)

    from kvchat.cli.app import main

    try:
        main(args)
    except SystemExit as e:
        dump()
        raise SystemExit(e.code) from None
    dump()


# ---- the parent ---------------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """pid and every process below it (Linux /proc)."""
    children: dict = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _sum_kib(pids: list[int], path: str, key: str) -> int:
    """Sum of the `key` lines (KiB) of /proc/PID/path over pids."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/{path}") as f:
                for line in f:
                    if line.startswith(key):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total


def run_once(cmd: list[str], env: dict, cwd: str) -> dict:
    """Run cmd; first answer byte, exit, CPU, ru_maxrss, peak tree RSS, return code, output."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    peak_tree = [0, 0]  # KiB: RSS, PSS
    done = threading.Event()

    def sample():  # RSS every 50 ms; Pss (smaps_rollup walks every page: costly) every 0.5 s
        n = 0
        while not done.wait(0.05):
            tree = _descendants(p.pid)
            peak_tree[0] = max(peak_tree[0], _sum_kib(tree, "status", "VmRSS:"))
            if n % 10 == 0:
                peak_tree[1] = max(peak_tree[1], _sum_kib(tree, "smaps_rollup", "Pss:"))
            n += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err_chunks: list = []
    reader = threading.Thread(target=lambda: err_chunks.append(p.stderr.read()), daemon=True)
    reader.start()
    got, first = b"", None
    while True:
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            break
        got += chunk
        if first is None and got.strip():
            first = time.perf_counter() - t0
    _, status, ru = os.wait4(p.pid, 0)
    total = time.perf_counter() - t0
    done.set()
    sampler.join()
    reader.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    return {
        "first_byte_s": first if first is not None else float("nan"),
        "exit_s": total,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "peak_rss_mib": ru.ru_maxrss / 1024,
        "tree_rss_mib": peak_tree[0] / 1024,
        "tree_pss_mib": peak_tree[1] / 1024,
        "rc": p.returncode,
        "stdout": got.decode(errors="replace"),
        "stderr_tail": b"".join(err_chunks).decode(errors="replace")[-2000:],
    }


def fresh_kvchat_cache(root: str) -> str:
    """A KVCHAT_CACHE holding only links to the known model files (as after `kvchat pull`)."""
    models = os.path.join(root, "models")
    os.makedirs(models)
    for path in MODELS.values():
        if path.exists():
            os.symlink(path, os.path.join(models, path.name))
    return root


def measure(model: str, opts, run_args: list[str]) -> dict:
    args = [a.replace("{model}", model) for a in run_args]
    tmp = tempfile.mkdtemp(prefix="kvchat-cold-")
    try:
        env = tree_env(opts.tree)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["NUMBA_CACHE_DIR"] = os.path.join(opts.keep_cache or tmp, "numba")
        os.makedirs(env["NUMBA_CACHE_DIR"])  # new and empty
        if opts.no_weight_cache:
            env["KVCHAT_WEIGHT_CACHE"] = "0"
        else:
            env["KVCHAT_CACHE"] = fresh_kvchat_cache(os.path.join(tmp, "kvchat"))
        table = os.path.join(tmp, "compiles.json")
        cwd = os.path.abspath(opts.tree) if opts.tree else tmp
        if opts.plain:
            cmd = [sys.executable, "-c", ENTRY, *args]
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", table, "--", *args]
            env["KVCHAT_COMPILE_WORKERS"] = "0"  # every compile in the child, where it is timed
        cold = run_once(cmd, env, cwd)
        if cold["rc"] != 0:
            raise SystemExit(f"cold_start: {model}: exit code {cold['rc']}\n{cold['stderr_tail']}")
        result = {"model": model, "args": args, "cold": cold}
        if not opts.plain:
            with open(table) as f:
                result["kernels"] = json.load(f)["kernels"]
        n_files = sum(len(fs) for _, _, fs in os.walk(env["NUMBA_CACHE_DIR"]))
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(env["NUMBA_CACHE_DIR"]) for f in fs)
        result["numba_cache"] = {"files": n_files, "mib": size / 2**20}
        if opts.warm:
            result["warm"] = run_once([sys.executable, "-c", ENTRY, *args], env, cwd)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(res: dict, top: int) -> None:
    c = res["cold"]
    print(f"\n## {' '.join(res['args'])}")
    print("| run | first byte s | exit s | CPU s | peak RSS MiB | tree RSS MiB | tree PSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k in ("cold", "warm"):
        if k in res:
            r = res[k]
            print(
                f"| {k} | {r['first_byte_s']:.2f} | {r['exit_s']:.2f} | {r['cpu_s']:.1f} | "
                f"{r['peak_rss_mib']:.0f} | {r['tree_rss_mib']:.0f} | {r['tree_pss_mib']:.0f} |"
            )
    nc = res["numba_cache"]
    print(f"numba cache written: {nc['files']} files, {nc['mib']:.1f} MiB; answer: {c['stdout'].strip()[:60]!r}")
    ks = res.get("kernels")
    if not ks:
        return
    tot = sum(r["seconds"] + r["save"] for r in ks.values())
    nsig = sum(len(r["sigs"]) for r in ks.values())
    print(f"\ncompiled: {len(ks)} dispatchers, {nsig} signatures, {tot:.1f} CPU s in compile events")
    print("| kernel | CPU s (exclusive) | cache write CPU s | signatures |")
    print("|---|---:|---:|---:|")
    rows = sorted(ks.items(), key=lambda kv: -(kv[1]["seconds"] + kv[1]["save"]))
    for name, r in rows[:top]:
        short = name.replace("kvchat.", "")
        print(f"| {short} | {r['seconds']:.2f} | {r['save']:.2f} | {len(r['sigs'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", help="smollm2, gemma3 or a .gguf path (repeatable)")
    ap.add_argument("--tree", help="the kvchat source tree to measure (default: the installed one)")
    ap.add_argument("--warm", action="store_true", help="run the command again on the same caches")
    ap.add_argument("--plain", action="store_true", help="the bare CLI in the child: no compile table")
    ap.add_argument("--no-weight-cache", action="store_true", help="KVCHAT_WEIGHT_CACHE=0, not a fresh KVCHAT_CACHE")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--keep-cache", help="keep the numba cache in DIR/numba (one model per DIR)")
    ap.add_argument("--json", help="write all measurements to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help="kvchat arguments after --; {model} is the -m value")
    opts = ap.parse_args()
    if opts.child:
        child(opts.child, opts.args)
        return
    run_args = opts.args or ["run", "-m", "{model}", "-p", "Hello", "-n", "16"]
    if opts.tree:
        check_tree(opts.tree, tree_env(opts.tree), os.path.abspath(opts.tree))
    results = []
    for model in opts.model or ["smollm2"]:
        res = measure(model, opts, run_args)
        report(res, opts.top)
        results.append(res)
        sys.stdout.flush()
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
