"""What `kvchat chat` and `kvchat run` share: from the flags to a live Conversation.

open_engine = resolve the model name, load it, make a Context from the flags, warm the kernels
up (numba compiles them on first use; the spinner says so; `run` skips it when the kernels a
warm-up loaded before are all still cached), pick the chat template.
make_conversation = the Conversation on it, its notices worded by cli/wording.py. Also the
Ctrl-C handling while an answer streams, the --session lock, and sampling settings taken
from a resumed session. The REPL and both commands import this module; it imports neither.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvchat.cli.chat.render import Renderer
from kvchat.cli.options import ChatSettings
from kvchat.cli.wording import event_text
from kvchat.runtime.chat.conversation import Conversation, ConversationConfig
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.sampling import Sampler, SamplingParams


@dataclass
class Engine:
    model: object
    ctx: object
    template: object  # ChatTemplate, or None when the model has none and none was given
    has_template: bool  # the model (or --chat-template-file) provides one
    identity: dict  # session.model_identity
    cache: dict  # session.cache_config
    compiling: object = None  # KernelsBehind while worker processes compile this run's kernels

    def kernels_ready(self, renderer) -> None:
        """Wait for kernels compiling behind the chat (if any), with a progress line; Ctrl-C
        raises KeyboardInterrupt with nothing changed (a later call waits again)."""
        if self.compiling is not None and not self.compiling.waited:
            self.compiling.wait(renderer)

    def kernels_finished(self, renderer) -> None:
        """After an answer: wait for the kernels still compiling (`run`, `pull`), so that the
        next start finds every kernel cached."""
        if self.compiling is not None:
            self.compiling.finish(renderer)

    @property
    def vocab(self):
        return self.model.vocab


FIRST_RUN = "compiling kernels, first run only (cached afterwards)…"
WORKERS_ENV = "KVCHAT_COMPILE_WORKERS"  # kvchat.runtime.startup.compile_ahead's; not part of a warm set's name


class KernelsBehind:
    """This run's kernels compiling in worker processes (kvchat.runtime.startup.compile_ahead): the wait
    for the serial set before a first answer, the serial hold until the rest is cached, and the
    wait for the rest after it. The next start, warm, records its warm-up (kernels/warm_set.py)."""

    def __init__(self, ahead, first_run: bool):
        self.ahead, self.first_run = ahead, first_run
        self.waited = False  # the serial set is in: answers may run

    @classmethod
    def start_if_needed(cls, path, cparams, first_run: bool):
        """Workers started on a first run (numba's cache holds no hot-path kernel for this source:
        a new install, a kvchat or numba upgrade) when workers are allowed
        (KVCHAT_COMPILE_WORKERS); else None. Started before the model loads: the first worker
        plans (kvchat.runtime.startup.compile_worker) while this process loads the weights, so the
        first answer's kernels compile from the first seconds on. A warm cache that only lacks
        a kernel or two (a new weight type) keeps the in-process warm-up: planning in a worker
        (its start, the model's load) would cost more than it saves."""
        from kvchat.runtime.startup.compile_ahead import CompileAhead, worker_count

        if not first_run or worker_count() < 1:
            return None
        return cls(CompileAhead(path, cparams).start(), first_run)

    def wait(self, renderer) -> None:
        """Block until the kernels a first answer needs are cached — the serial twins, which the
        workers compile first (progress `kernels 12/20` on stderr) — then hold every kernel to
        its serial twin (kernels.parallel.hold_serial) until the workers have the parallel twins
        cached too, when a thread gives the thresholds back: the answer starts a parallel
        compile's time sooner, on one core, with the same bits."""
        with renderer.progress(FIRST_RUN if self.first_run else "compiling kernels…") as show, sigint_raises():
            self.ahead.wait(_counted(show), serial=True)
        self.waited = True
        if self.ahead.finished:
            self._done()
            return
        from kvchat.kernels import parallel

        parallel.hold_serial()
        threading.Thread(target=self._release_when_finished, daemon=True, name="compile-release").start()

    def _release_when_finished(self) -> None:
        self.ahead.wait()
        self._done()

    def _done(self) -> None:
        from kvchat.kernels import parallel
        from kvchat.runtime.weights.os_memory import release_library_pages

        self.ahead.close()
        parallel.release()
        release_library_pages()

    def finish(self, renderer) -> None:
        """Wait for the rest of the kernels (the parallel twins) after an answer that did not
        need them, so that the next start is warm (`run`, `pull`); Ctrl-C stops the workers."""
        if self.ahead.finished:
            return
        try:
            with renderer.progress(REST) as show, sigint_raises():
                self.ahead.wait(_counted(show))
        except KeyboardInterrupt:
            self.ahead.close(kill=True)
        self._done()

    def close(self) -> None:
        """The chat ends before its kernels were needed: the workers stop now (the kernels they
        finished stay cached; the next start plans the rest)."""
        self.ahead.close(kill=True)


KERNELS = "kernels {}/{}"  # the progress line while a run waits for its compile workers
REST = "compiling the rest of the kernels, first run only…"  # after an answer: the parallel twins


def _counted(show):
    """A CompileAhead.wait progress callback showing `kernels done/total` (nothing while planning)."""
    return lambda done, total: show(KERNELS.format(done, total) if total else None)


AUTO_SEQS = 4  # n_seq_max of the chat's "auto" (--parallel 0): branches and /alts answers


@dataclass
class EngineStart:
    """What open_engine settles before the model loads: the file, whether numba's cache is cold,
    the context parameters, and the compile workers started for a cold one (KernelsBehind)."""

    path: Path
    first_run: bool
    cparams: object
    behind: KernelsBehind | None


def start_engine(
    settings: ChatSettings, renderer: Renderer, n_seq_max: int = 1, kv_unified: bool = True
) -> EngineStart:
    """Resolve the model (fetched with a progress bar when missing) and, on a first run, start
    the compile workers — before the load: the first worker plans while this process loads."""
    from kvchat.cli.sources.models import resolve_model
    from kvchat.kernels.jit_cache import kernels_compiled

    path = resolve_model(settings.model, renderer.err_console)
    first_run = not kernels_compiled()  # numba compiles while loading and warming up
    cparams = settings.context_params(n_seq_max=n_seq_max or AUTO_SEQS, kv_unified=kv_unified)
    return EngineStart(path, first_run, cparams, KernelsBehind.start_if_needed(path, cparams, first_run))


def open_engine(
    settings: ChatSettings,
    renderer: Renderer,
    stop_event,
    n_seq_max: int = 1,
    kv_unified: bool = True,
    skip_cached_warm_up: bool = False,
    compile_behind: bool = False,
    start: EngineStart | None = None,
) -> Engine:
    """Model + Context + template from the flags; KvchatError (one line) for bad input.
    skip_cached_warm_up (`run`): no warm-up when it would only load cached kernels — the
    prompt loads them next anyway; the chat keeps it, as it runs while the user reads the prompt
    and would otherwise land in the first answer.
    When the kernels this run needs are not all cached, worker processes compile them
    (kvchat.runtime.startup.compile_ahead); with compile_behind (the chat) open_engine returns at once
    and the first answer waits for them (Engine.kernels_ready), else it waits here.
    start: start_engine's result when the caller took that step itself (the chat's first run
    loads on a thread behind its prompt: cli/chat/load_behind.py)."""
    from kvchat.cli.session.session import cache_config, model_identity
    from kvchat.runtime.context import Context
    from kvchat.runtime.model import Model
    from kvchat.runtime.text.chat_template import ChatTemplate

    start = start or start_engine(settings, renderer, n_seq_max, kv_unified)
    path, first_run, cparams, behind = start.path, start.first_run, start.cparams, start.behind
    try:
        with renderer.spinner(f"loading {Path(path).name}" + (f" ({FIRST_RUN})" if first_run else "")):
            model = Model.load(path, first_run=behind is not None)  # as the planning worker loads it
        ctx = Context(model, cparams, abort_callback=stop_event.is_set)
    except BaseException:
        if behind is not None:
            behind.close()
        raise
    if not n_seq_max:  # auto: room for branches in a KV cache; a recurrent state per sequence costs more
        if not ctx.memory.get_can_trim():
            ctx = Context(
                model, settings.context_params(n_seq_max=1, kv_unified=kv_unified), abort_callback=stop_event.is_set
            )
    for w in getattr(ctx.cparams, "warnings", []):
        renderer.warn(w)
    if behind is None:
        warm_up_kernels(ctx, model, path, renderer, first_run, skip_if_cached=skip_cached_warm_up)
        from kvchat.runtime.weights.os_memory import release_library_pages

        release_library_pages()  # the kernels are linked: LLVM's pages leave the resident set
    elif not compile_behind:
        behind.wait(renderer)  # the serial set; the rest compiles on (Engine.kernels_finished)
    if settings.chat_template_file is not None:
        template, has = ChatTemplate.from_file(settings.chat_template_file, model.vocab), True
    else:
        has = isinstance(model.gguf.get("tokenizer.chat_template"), str)
        template = ChatTemplate.from_gguf(model.gguf, model.vocab)
    identity = model_identity(path, getattr(model.gguf, "data_offset", None))
    return Engine(model, ctx, template, has, identity, cache_config(ctx.cparams), behind)


def warm_set_name(ctx, path) -> str:
    """The name of the kernels a warm-up of this model file and context loads (kernels/warm_set.py)."""
    from kvchat.kernels import warm_set

    st = os.stat(path)
    return warm_set.name_for(
        str(Path(path).resolve()),
        st.st_size,
        st.st_mtime_ns,
        ctx.cparams,
        sorted((k, v) for k, v in os.environ.items() if k.startswith("KVCHAT_") and k != WORKERS_ENV),
    )


def warm_up_kernels(ctx, model, path, renderer, first_run: bool, skip_if_cached: bool = False) -> None:
    """Decode a few tokens before the prompt so that kernels compile under a spinner — 64 on a
    first run (the parallel twins too), 2 otherwise. With skip_if_cached, not when the kernels a
    warm-up of this model and context loaded before are all still in numba's cache
    (kernels/warm_set.py): then it would only load them, which the prompt does anyway."""
    from kvchat.kernels import warm_set

    name = warm_set_name(ctx, path)
    if skip_if_cached and not first_run and warm_set.covered(name):
        return
    with renderer.spinner(FIRST_RUN if first_run else "warming up kernels"):
        from kvchat.runtime.generate import warm_up

        bos = getattr(model.vocab, "bos", None)
        warm_up(ctx, bos if bos is not None and bos >= 0 else 0, n_prompt=64 if first_run else 2)
    warm_set.record(name)


def make_conversation(
    engine: Engine, settings: ChatSettings, renderer: Renderer, stop_event, raw: bool = False, grammar=None
) -> Conversation:
    """The Conversation from the flags; `grammar` (a checked GrammarSpec) constrains its answers."""
    config = ConversationConfig(
        n_predict=settings.n_predict,
        context_shift=settings.context_shift,
        keep=settings.keep,
        ignore_eos=settings.ignore_eos,
        raw=raw,
        system_prompt=None if raw else settings.system_prompt,
        reasoning=settings.reasoning,
        reasoning_budget=settings.reasoning_budget,
        reasoning_effort=settings.reasoning_effort,
    )
    try:
        sampler = Sampler(settings.sampling())
    except ValueError as e:
        raise KvchatError(str(e)) from None
    conv = Conversation(
        engine.ctx,
        engine.vocab,
        None if raw else engine.template,
        sampler,
        config,
        notify=lambda event: renderer.notice(event_text(event)),
        stop_event=stop_event,
    )
    if settings.verbose_prompt:
        conv.on_prompt = lambda ids: renderer.verbose_prompt(engine.vocab, ids)
    conv.speculative = make_speculator(engine, settings, renderer, stop_event)
    if grammar is not None:
        from kvchat.runtime.grammar.matcher import Constraint

        conv.constraint = Constraint(grammar, engine.vocab)
    return conv


def make_speculator(engine: Engine, settings: ChatSettings, renderer: Renderer, stop_event):
    """The Speculator the flags ask for (-md, --spec-type, --draft-max/min), or None; its draft
    model loaded and warmed up under the spinner."""
    kind = settings.spec_type or ("draft" if settings.model_draft else None)
    if kind is None:
        return None
    if settings.model_draft is not None and kind != "draft":
        raise KvchatError(f"-md is the draft model of --spec-type draft, not of {kind}: drop one of them")
    from kvchat.runtime.speculative import make_speculator as build

    draft_path = None
    if kind == "draft":
        if settings.model_draft is None:
            raise KvchatError("--spec-type draft needs a draft model: give -md FILE")
        from kvchat.cli.sources.models import resolve_model

        draft_path = resolve_model(settings.model_draft, renderer.err_console)
    with renderer.spinner(f"preparing the draft ({kind})"):
        spec = build(
            engine.ctx,
            kind,
            draft_path=draft_path,
            draft_max=settings.draft_max,
            draft_min=settings.draft_min,
            draft_p_min=settings.draft_p_min,
            abort_callback=stop_event.is_set,
        )
        warm_up = getattr(spec.source, "warm_up", None)  # a model draft's kernels
        if warm_up is not None:
            bos = getattr(engine.vocab, "bos", None)
            warm_up(bos if bos is not None and bos >= 0 else 0)
    return spec


@contextmanager
def sigint_sets(event):
    """While generating, Ctrl-C sets `event` (stop at the next token) instead of raising."""
    if not hasattr(signal, "SIGINT"):
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if event.is_set():  # a second Ctrl-C while stopping: give up the normal way
            raise KeyboardInterrupt
        event.set()

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def sigint_raises():
    """While waiting, Ctrl-C raises KeyboardInterrupt — also in a process started with SIGINT
    ignored (a background job), as the answer's Ctrl-C (sigint_sets) works there too."""
    if not hasattr(signal, "SIGINT"):
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def apply_saved_sampling(conv: Conversation, saved: dict, settings: ChatSettings | None) -> None:
    """Sampling settings from a session, except those given explicitly on the command line."""
    defaults = ChatSettings()
    merged = conv.sampler.params.to_dict()
    for key, value in SamplingParams.from_dict(saved).to_dict().items():
        if settings is None or getattr(settings, key) == getattr(defaults, key):
            merged[key] = value
    try:
        conv.sampler = Sampler(SamplingParams.from_dict(merged))
    except ValueError as e:
        raise KvchatError(f"session sampling settings: {e}") from None


def should_resume(settings, renderer) -> bool:
    """Resume --session FILE when it exists — unless it is not a session and --force was given:
    then the chat starts afresh and its first save replaces FILE (said once)."""
    path = settings.session
    if path is None or not path.exists():
        return False
    if settings.force:
        from kvchat.cli.session.file import is_session_file

        if not is_session_file(path):
            renderer.notice(
                f"{path} is not a kvchat session: starting a new conversation (--force: the first save replaces it)"
            )
            return False
    return True


def hold_session_lock(path):
    """Lock a --session file for this process's life (None without one); SessionError naming
    the process that holds it, so two processes never save over each other's turns."""
    if path is None:
        return None
    import atexit

    from kvchat.cli.session.file import SessionLock

    lock = SessionLock(path).acquire()
    atexit.register(lock.release)  # removes the lock file; the kernel drops the lock anyway
    return lock
