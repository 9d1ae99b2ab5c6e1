"""Start-up of `kvchat run`: wall time to the first answer byte, side by side, and where it goes.

Side by side (each round runs every command once, in turn; medians over rounds):

    python benchmarks/startup.py --tree /work/main --tree . \\
        --llama-completion BIN -r 5 -- run -m smollm2 -p hi -n 16

  Each --tree runs `python -c "from kvchat.cli.app import main; main()" ARGS...` with kvchat.* taken
  from TREE (benchmarks/tree_env.py: a shim package first on PYTHONPATH; each tree is checked to be
  the one the child imports) and stdout on a pipe; "first byte" is when the first answer byte
  arrives on the pipe, "exit" when the process ends. llama-completion runs with `-m FILE -p PROMPT
  -n N -no-cnv -t 2` (the model file and -p/-n taken from ARGS); it echoes the prompt before
  decoding it, so its "first byte" is the first byte after that echo — its first generated token.
  .pyc files are written (PYTHONDONTWRITEBYTECODE is removed from the children's environment, as on
  a user's machine).

What a start-up piece saves (`--skip PIECES`, repeatable: the first tree again with
KVCHAT_STARTUP_SKIP=PIECES, one column each; kernels/numba_start.py names the pieces):

    python benchmarks/startup.py --tree . --skip fast_args,fast_params --skip lean_cache_loads \\
        -r 9 -- run -m smollm2 -p hi -n 16

Phases (`--phases`, one column per --tree, rounds alternated): the same command run in-process by a child, with
perf_counter marks around
the calls a warm start makes (imports, GGUF parse, vocabulary, weights, context, warm-up, the
prompt up to the first answer byte), medians over rounds. Times are measured from the child's
spawn (the parent passes its wall clock), so the interpreter's own start is the first row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tree_env import ENTRY, check_tree, tree_env, use_tree  # noqa: E402

# (module, attribute) wrapped in --phases mode; classes as "Class.method". Rows print in this order.
PHASES = [
    ("kvchat.cli.sources.models", "resolve_model", "resolve -m", None),
    ("kvchat.kernels.jit_cache", "kernels_compiled", "numba cache probe", None),
    ("kvchat.runtime.gguf.split", "open_gguf", "GGUF parse (open_gguf)", "kvchat.runtime.model"),
    ("kvchat.runtime.text.vocab", "Vocab.from_gguf", "vocabulary (Vocab.from_gguf)", None),
    ("kvchat.runtime.model", "load_weights", "weights (load_weights)", None),
    ("kvchat.runtime.weights.os_memory", "release_library_pages", "release_library_pages", "kvchat.runtime.model"),
    ("kvchat.runtime.context", "Context.__init__", "Context()", None),
    ("kvchat.runtime.generate", "warm_up", "warm-up", None),
    ("kvchat.runtime.text.chat_template", "ChatTemplate.from_gguf", "chat template", None),
    ("kvchat.cli.session.session", "model_identity", "model identity", None),
    ("kvchat.cli.commands.run_prompt_cache", "warm", "prompt cache", None),
    ("kvchat.runtime.chat.conversation", "Conversation.render", "render the prompt", None),
    ("kvchat.runtime.chat.conversation", "Conversation.prefill", "prompt decode (prefill)", None),
]


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _clean_env(tree: str | None) -> dict:
    env = tree_env(tree)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def time_first_byte(cmd: list[str], env: dict, skip: bytes = b"", cwd=None) -> tuple[float, float, int, float]:
    """(seconds to the first stdout byte past the echoed `skip`, seconds to exit, return code,
    CPU seconds of the process: user + system, from its rusage)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    got = b""
    first = None
    while True:
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            break
        got += chunk
        if first is None and len(got) > (len(skip) if got.startswith(skip) else 0):
            first = time.perf_counter() - t0
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    return (first if first is not None else float("nan")), time.perf_counter() - t0, p.returncode, cpu


def _arg(args: list[str], *names: str, default=None):
    for i, a in enumerate(args[:-1]):
        if a in names:
            return args[i + 1]
    return default


def llama_cmd(binary: str, args: list[str]) -> tuple[list[str], bytes]:
    use_tree(os.path.dirname(HERE))
    from rich.console import Console

    from kvchat.cli.sources.models import resolve_model

    path = resolve_model(_arg(args, "-m", "--model", default="smollm2"), Console(stderr=True))
    prompt = _arg(args, "-p", "--prompt", default="hi")
    n = _arg(args, "-n", "--n-predict", default="16")
    return [binary, "-m", str(path), "-p", prompt, "-n", n, "-no-cnv", "-t", "2"], prompt.encode()


def side_by_side(opts, args: list[str]) -> None:
    runs = []  # (label, cmd, env, skip, cwd): `python -c` puts its working directory first on
    for tree in opts.tree:  # sys.path, so each tree runs from its own directory
        check_tree(tree, _clean_env(tree), os.path.abspath(tree))
        runs.append(
            (
                f"kvchat {tree}",
                [sys.executable, "-c", ENTRY, *args],
                _clean_env(tree),
                b"",
                os.path.abspath(tree),
            )
        )
    for pieces in opts.skip:
        tree = opts.tree[0] if opts.tree else os.path.dirname(HERE)
        env = dict(_clean_env(tree), KVCHAT_STARTUP_SKIP=pieces)
        cmd = [sys.executable, "-c", ENTRY, *args]
        runs.append((f"kvchat without {pieces}", cmd, env, b"", os.path.abspath(tree)))
    if opts.llama_completion:
        cmd, echo = llama_cmd(opts.llama_completion, args)
        runs.append(("llama-completion", cmd, _clean_env(None), echo, None))
    res = {label: ([], [], []) for label, *_ in runs}
    for r in range(opts.rounds):
        for label, cmd, env, skip, cwd in runs if r % 2 == 0 else runs[::-1]:  # alternated order
            first, total, rc, cpu = time_first_byte(cmd, env, skip, cwd)
            if rc != 0:
                sys.exit(f"{label}: exit code {rc}")
            res[label][0].append(first)
            res[label][1].append(total)
            res[label][2].append(cpu)
            print(
                f"round {r + 1}: {label}: first byte {first:.3f} s, exit {total:.3f} s, CPU {cpu:.3f} s",
                file=sys.stderr,
            )
    print(f"{'':44s} {'first byte':>11s} {'exit':>8s} {'CPU':>8s}   (medians of {opts.rounds}, s)")
    for label, (firsts, totals, cpus) in res.items():
        print(
            f"{label:44s} {_median(firsts):11.3f} {_median(totals):8.3f} {_median(cpus):8.3f}   "
            f"first bytes {' '.join(f'{x:.2f}' for x in firsts)}"
        )


# ---- --phases ---------------------------------------------------------------------------------


def _wrap(marks: dict, module: str, attr: str, label: str, also) -> None:
    import importlib

    mod = importlib.import_module(module)
    owner, name = (mod, attr) if "." not in attr else (getattr(mod, attr.split(".")[0]), attr.split(".")[1])
    raw = owner.__dict__[name]
    is_cm = isinstance(raw, classmethod)
    fn = raw.__func__ if is_cm else raw

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            marks[label] = marks.get(label, 0.0) + time.perf_counter() - t

    wrapped = classmethod(timed) if is_cm else timed
    setattr(owner, name, wrapped)
    if also:
        setattr(importlib.import_module(also), name, wrapped)


def child_phases(args: list[str]) -> None:
    """Run the CLI in-process with marks; write {label: seconds} as JSON to $STARTUP_OUT."""
    spawn = float(os.environ["STARTUP_SPAWN"])
    t_start = time.time() - spawn  # the interpreter's start, up to this line
    t0 = time.perf_counter()
    marks: dict = {}
    import kvchat.cli.app  # noqa: F401

    marks["import kvchat.cli.app"] = time.perf_counter() - t0
    from kvchat.cli.chat.render import Renderer

    first = {}
    piece = Renderer.piece

    def timed_piece(self, text):
        if text and "first" not in first:
            first["first"] = time.perf_counter()
        return piece(self, text)

    Renderer.piece = timed_piece
    for module, attr, label, also in PHASES:
        _wrap(marks, module, attr, label, also)
    try:
        kvchat.cli.app.main(args)
    except SystemExit as e:
        if e.code:
            raise
    end = time.perf_counter()
    out = {
        "interpreter start": t_start,
        **marks,
        "first answer byte": t_start + first.get("first", float("nan")) - t0,
        "exit": t_start + end - t0,
    }
    with open(os.environ["STARTUP_OUT"], "w") as f:
        json.dump(out, f)


def _phase_round(tree: str, args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = _clean_env(tree)
    env.update(STARTUP_OUT=out, STARTUP_SPAWN=repr(time.time()))
    subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child-phases", "--", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        check=True,
        cwd=os.path.abspath(tree),
    )
    with open(out) as f:
        marks = json.load(f)
    os.unlink(out)
    return marks


def phases(opts, args: list[str]) -> None:
    """One column per --tree, the trees' rounds alternated (A B A B ...), medians."""
    trees = opts.tree or [os.path.dirname(HERE)]
    for t in trees:
        check_tree(t, _clean_env(t), os.path.abspath(t))
    rows = {t: {} for t in trees}
    for _ in range(opts.rounds):
        for t in trees:
            for k, v in _phase_round(t, args).items():
                rows[t].setdefault(k, []).append(v)
    table = {}
    for t in trees:
        r = rows[t]
        named = [k for k in r if k not in ("first answer byte", "exit", "interpreter start")]
        other = [
            r["first answer byte"][i] - sum(r[k][i] for k in named + ["interpreter start"]) for i in range(opts.rounds)
        ]
        col = {k: _median(r[k]) for k in ["interpreter start", *named]}
        col["other (later imports, argument parsing, ...)"] = _median(other)
        col["= first answer byte"] = _median(r["first answer byte"])
        col["exit"] = _median(r["exit"])
        table[t] = col
    labels = list(dict.fromkeys(k for col in table.values() for k in col))
    print(
        f"{'phase (median s, ' + str(opts.rounds) + ' rounds)':44s} "
        + " ".join(f"{os.path.basename(t.rstrip('/')):>14s}" for t in trees)
    )
    for k in labels:
        print(f"{k:44s} " + " ".join(f"{table[t].get(k, float('nan')):14.3f}" for t in trees))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="a kvchat source tree (repeat to compare)")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        help="also run this tree with KVCHAT_STARTUP_SKIP=PIECES (comma list of kernels/numba_start.py's pieces, "
        "fast_args, fast_params): what those pieces are worth, side by side (repeat for more columns)",
    )
    ap.add_argument("--llama-completion", help="llama-completion binary to run side by side")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--phases", action="store_true", help="phase table of each --tree (or this one), rounds alternated")
    ap.add_argument("--child-phases", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help="kvchat arguments, after --")
    opts = ap.parse_args()
    args = opts.args or ["run", "-m", "smollm2", "-p", "hi", "-n", "16"]
    if opts.child_phases:
        child_phases(args)
    elif opts.phases:
        phases(opts, args)
    else:
        if not opts.tree:
            opts.tree = [os.path.dirname(HERE)]
        side_by_side(opts, args)


if __name__ == "__main__":
    main()
