"""`kvchat run -np N` (alternatives of one prompt) and `kvchat run --prompts-file F -np N`
(many prompts, continuous batching): the command-line side of runtime/serving/parallel.py.

Prompts are rendered exactly as `kvchat run` renders one (chat template, system prompt, raw
mode), so each answer's text is the one `kvchat run` alone prints for that prompt and seed:
answer i of `-np N` uses seed S+i, request i of a prompts file seed S+i (S = --seed, or one
random seed for the run, reported). Answers go to stdout - numbered blocks, or with --jsonl one
JSON object per line - in input order; progress (llama-parallel's per-request lines and summary)
goes to stderr.
"""

from __future__ import annotations

import json
import secrets
import sys
from os.path import commonprefix
from pathlib import Path

from kvchat.runtime.errors import KvchatError
from kvchat.runtime.serving.parallel import ParallelRunner, Request, Result, alternatives


def read_prompts_file(path: Path) -> list[tuple[str | None, list | None, str | None, object]]:
    """[(prompt text, chat messages, error, grammar spec or None)] per request: one prompt per
    non-empty line of a text file; a .jsonl file has one object per line with "prompt" (text) or
    "messages" (chat), and may carry a "json_schema" (object or text) its answer must follow. A
    line that cannot be used (bad JSON, a schema that does not compile) is that request's error."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise KvchatError(f"cannot read prompts file {path}: {getattr(e, 'strerror', None) or e}") from None
    jsonl = str(path).endswith(".jsonl")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            out.append((line, None, None, None))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.append((None, None, f"{path}:{n}: not JSON ({e.msg})", None))
            continue
        msgs = obj.get("messages") if isinstance(obj, dict) else None
        spec, err = _request_schema(obj, f"{path}:{n}")
        if err is not None:
            out.append((None, None, err, None))
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            out.append((obj["prompt"], None, None, spec))
        elif (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            out.append((None, [{"role": m["role"], "content": m["content"]} for m in msgs], None, spec))
        else:
            out.append(
                (
                    None,
                    None,
                    f"{path}:{n}: expected {{\"prompt\": text}} or "
                    "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]}",
                    None,
                )
            )
    if not out:
        raise KvchatError(f"prompts file {path} holds no prompt")
    return out


def _request_schema(obj, where: str):
    """(GrammarSpec or None, error or None) of a request's own "json_schema"."""
    if not isinstance(obj, dict) or obj.get("json_schema") is None:
        return None, None
    from kvchat.runtime.errors import GrammarError
    from kvchat.runtime.grammar.spec import GrammarSpec

    schema = obj["json_schema"]
    spec = GrammarSpec(
        "json_schema", schema if isinstance(schema, str) else json.dumps(schema), f"{where}: json_schema"
    )
    try:
        spec.compile()
    except GrammarError as e:
        return None, str(e)
    return spec, None


def render_ids(conv, text: str | None, messages: list | None) -> list[int]:
    """The prompt tokens `kvchat run` would decode for this text (or these chat messages)."""
    if messages is None:
        messages = [m for m in conv.messages if m["role"] == "system"] + [{"role": "user", "content": text}]
    elif conv.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": conv.system_prompt}] + messages
    return conv.render(messages)


def _err(line: str) -> None:
    """A progress line on stderr, unwrapped (they are parsed by scripts as llama-parallel's are)."""
    print(line, file=sys.stderr, flush=True)


def base_seed(settings) -> int:
    return int(settings.seed) if settings.seed is not None else secrets.randbits(32)


def _print_answer(res: Result, jsonl: bool, what: str) -> None:
    if jsonl:
        print(json.dumps(res.json(), ensure_ascii=False), flush=True)
    elif res.error:
        print(f"{what} {res.index}: error: {res.error}\n", flush=True)
    else:
        print(f"{what} {res.index} (seed {res.seed}):\n{res.text}\n", flush=True)


def run_alternatives(engine, conv, settings, text: str, n: int, jsonl: bool, stop, renderer) -> None:
    ids = render_ids(conv, text, None) if not conv.config.raw else conv.render([{"role": "user", "content": text}])
    seed = base_seed(settings)
    runner = ParallelRunner(
        engine.ctx,
        engine.vocab,
        settings.sampling(),
        n,
        settings.n_predict,
        settings.ignore_eos,
        stop_event=stop,
        constraint=conv.constraint,
        reasoning=conv.reasoning_parser if conv.reasoning_parser([]) is not None else None,
    )
    results = alternatives(runner, ids, [seed + i for i in range(n)])
    for r in results:
        _print_answer(r, jsonl, "sequence")
    n_gen = sum(r.n_gen for r in results)
    t = runner.t_total
    _err(
        f"main: n_parallel = {n}, prompt {len(ids)} tokens (decoded once), "
        f"generated {n_gen} tokens in {t:.2f} s, speed: {n_gen / t if t else 0:.2f} t/s"
    )
    if any(r.stop == "interrupted" for r in results):
        raise SystemExit(130)


def run_prompts_file(engine, conv, settings, path: Path, n: int, jsonl: bool, stop, renderer) -> None:
    items = read_prompts_file(path)
    seed = base_seed(settings)
    reqs = []
    constraints = {}  # one compiled Constraint per distinct schema text
    for i, (text, msgs, err, spec) in enumerate(items):
        label = text if text is not None else (msgs[-1]["content"] if msgs else "")
        ids = None
        if err is None:
            try:
                ids = (
                    render_ids(conv, text, msgs)
                    if not conv.config.raw
                    else conv.render(msgs or [{"role": "user", "content": text}])
                )
            except KvchatError as e:
                err = str(e)
            except Exception as e:  # a template that rejects these messages
                err = f"cannot render the prompt: {e}"
        constraint = None
        if spec is not None and err is None:
            from kvchat.runtime.grammar.matcher import Constraint

            if spec.text not in constraints:
                constraints[spec.text] = Constraint(spec, engine.vocab)
            constraint = constraints[spec.text]
        reqs.append(Request(index=i, ids=ids, seed=seed + i, label=label, error=err, constraint=constraint))
    runner = ParallelRunner(
        engine.ctx,
        engine.vocab,
        settings.sampling(),
        n,
        settings.n_predict,
        settings.ignore_eos,
        stop_event=stop,
        constraint=conv.constraint,
        reasoning=conv.reasoning_parser if conv.reasoning_parser([]) is not None else None,
    )
    ok_ids = [r.ids for r in reqs if r.ids and runner.check_fits(r) is None]
    shared = list(commonprefix(ok_ids)) if len(ok_ids) > 1 else []
    if ok_ids and len(shared) >= min(len(x) for x in ok_ids):
        shared = shared[:-1]  # every request decodes at least its last token
    _err(f"main: n_parallel = {n}, n_sequences = {len(reqs)}, cont_batching = 1, system tokens = {len(shared)}")
    done: dict[int, Result] = {}
    state = {"next": 0}

    def on_result(res: Result) -> None:
        speed = res.n_gen / (res.t_prompt + res.t_gen) if (res.t_prompt + res.t_gen) > 0 else 0.0
        label = res.label.replace("\n", " ")
        if res.error:
            _err(f"Client {res.seq_id:3d}, seq {res.index:3d}/{len(reqs):3d}, failed: {res.error}  Input: {label[:60]}")
        else:
            _err(
                f"Client {res.seq_id:3d}, seq {res.index:3d}/{len(reqs):3d}, prompt "
                f"{res.n_prompt:4d} t, response {res.n_gen:4d} t, time "
                f"{res.t_prompt + res.t_gen:5.2f} s, speed {speed:5.2f} t/s, cache miss "
                f"{runner.n_cache_miss}  Input: {label[:60]}"
            )
        done[res.index] = res
        while state["next"] in done:  # results in input order, as soon as they can be
            _print_answer(done[state["next"]], jsonl, "request")
            state["next"] += 1

    results = runner.run(reqs, on_result=on_result, shared_prefix=shared)
    for r in results[state["next"] :]:
        _print_answer(r, jsonl, "request")
    t = runner.t_total or 1e-9
    n_prompt = runner.n_prompt_decoded
    n_gen = sum(r.n_gen for r in results)
    _err(f"main: n_parallel = {n}, n_sequences = {len(reqs)}, cont_batching = 1, system tokens = {len(shared)}")
    _err(f"External prompt file: {path}")
    _err(f"Total prompt tokens: {n_prompt:6d}, speed: {n_prompt / t:5.2f} t/s")
    _err(f"Total gen tokens:    {n_gen:6d}, speed: {n_gen / t:5.2f} t/s")
    _err(f"Total speed (AVG):   {'':6s}  speed: {(n_prompt + n_gen) / t:5.2f} t/s")
    _err(f"Cache misses:        {runner.n_cache_miss:6d}")
    if any(r.stop == "interrupted" for r in results):
        raise SystemExit(130)


def n_seq_max_for(parallel: int, prompts_file) -> int:
    """Sequences the context needs: one per answer, plus the shared-prefix holder for a file."""
    return parallel + (1 if prompts_file is not None else 0)
