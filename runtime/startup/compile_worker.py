"""One compile worker process (`python -m kvchat.runtime.startup.compile_worker`), driven by
kvchat.runtime.startup.compile_ahead over its stdin/stdout: pickled messages, one at a time.

Requests, answered in order:
- ("plan", model_path, cparams, n_prompt): load the model (its weights under a dry run too,
  without the weight cache: the caller loads them for real at the same time, so the plan does
  not wait for the repack kernels; without its vocabulary, whose kernels the caller compiles),
  make a Context with those parameters and run a warm-up decode (n_prompt tokens, then one) under
  kvchat.kernels.compile_plan.dry_run(): the answer is ("planned", (serial, parallel)) — the
  (kernel, signature) pairs the run calls that numba's cache does not hold yet, in call
  order: first those it calls with every kernel held to its serial twin, then the rest, and
  last the kernels of the formats the load held as others (kernels/stand_in.py) and the
  vocabulary's, which the caller's first run replaces by Python twins and the next load calls —
  or ("failed", text).
  The dry run leaves garbage in the model's outputs, so this process plans once and then only
  compiles; the model and context are dropped before the answer.
- ("compile", i, entry): compile_plan.compile_entry(entry), which writes numba's cache; the
  answer is ("done", i, seconds, cpu seconds, error text or None, resident bytes now).
- ("exit",) or end of input: the process ends.

numba's cache saves go through kvchat.kernels.cache_writes (installed with the kernels), so
this process, its sibling and the chat itself can write one cache at the same time. stdout is
the channel: anything printed by the code it runs goes to stderr instead.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback


def plan(model_path: str, cparams, n_prompt: int) -> tuple[list, list]:
    """The entries a warm-up decode of this model and context calls (module docstring), as
    (serial, parallel): those it calls with every kernel held to its serial twin
    (kernels.parallel.hold_serial), which a first answer needs, then the rest."""
    from kvchat.kernels import parallel
    from kvchat.kernels.compile_plan import dry_run, is_cached
    from kvchat.kernels.matmul import format_entries
    from kvchat.runtime.context import Context
    from kvchat.runtime.generate import warm_up
    from kvchat.runtime.model import Model

    os.environ["KVCHAT_WEIGHT_CACHE"] = "0"  # dry weights are garbage: never saved as a pack
    # no vocabulary (the caller compiles its kernels); formats held as others as in the caller's load
    model = Model.load(model_path, weights_context=dry_run, first_run=True, vocab=False)
    ctx = Context(model, cparams)
    bos = model.gguf.get("tokenizer.ggml.bos_token_id")
    bos = bos if isinstance(bos, int) and 0 <= bos < ctx.n_vocab else 0
    parallel.hold_serial()
    try:
        with dry_run() as serial:
            warm_up(ctx, bos, n_prompt=n_prompt)
    finally:
        parallel.release()
    with dry_run() as both:
        warm_up(ctx, bos, n_prompt=n_prompt)
    native = [e for t in model.stand_ins for e in format_entries(t)] + vocab_entries()  # for the next load, last
    serial = [e for e in serial if not is_cached(e)]
    rest = [e for e in both if e not in serial]
    rest += [e for e in native if e not in rest and e not in serial]
    return serial, [e for e in rest if not is_cached(e)]


def vocab_entries() -> list:
    """The vocabulary's kernels, as a GGUF file and a string index call them: a first run reads its
    vocabulary with their Python twins (kernels/compile_plan.compiling_behind), so the plan lists
    them for the next run."""
    import numpy as np

    from kvchat.kernels.compile_plan import entry_of
    from kvchat.kernels.gguf_strings import scan_strings
    from kvchat.runtime.gguf.string_array import StringArray, _build_table, table_args

    mapped = np.frombuffer(bytes(8), np.uint8)  # read-only, as GGUFFile's view of its map
    return [
        entry_of(scan_strings, (mapped, 0, 1)),
        entry_of(_build_table, table_args(StringArray.from_strings(["a"]), 16)),
    ]


def resident_bytes() -> int:
    """This process's resident set now (0 where /proc is missing): numba keeps every module it
    compiled, so a worker grows with each kernel."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def answer(request) -> tuple:
    kind = request[0]
    if kind == "plan":
        try:
            return ("planned", plan(*request[1:]))
        except Exception:
            return ("failed", traceback.format_exc(limit=4))
    if kind == "compile":
        from kvchat.kernels.compile_plan import compile_entry

        i, entry = request[1], request[2]
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            compile_entry(entry)
            error = None
        except Exception as e:  # the chat compiles it itself when it calls it
            error = f"{type(e).__name__}: {e}"
        return ("done", i, time.perf_counter() - t0, time.process_time() - c0, error, resident_bytes())
    return ("failed", f"unknown request {kind!r}")


def end_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it ends (the chat killed
    mid-compile must not leave a worker compiling for minutes); elsewhere it ends at its next read."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    end_with_parent()
    channel_in = sys.stdin.buffer
    channel_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # prints of the code run here must not corrupt the channel
    from kvchat.kernels.numba_start import install

    install()  # numba set up as in the chat: threading layer, cache writes safe beside the chat's

    while True:
        try:
            request = pickle.load(channel_in)
        except (EOFError, pickle.UnpicklingError):
            return
        if request[0] == "exit":
            return
        pickle.dump(answer(request), channel_out, protocol=pickle.HIGHEST_PROTOCOL)
        channel_out.flush()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the chat's Ctrl-C reaches its process group: not ours to act on
        pass
