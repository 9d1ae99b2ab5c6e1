"""The chat's branch and alternative commands (/branch /switch /branches /drop /alts /pick),
mixed into cli/chat/repl.py's Repl, and session files that hold every branch.

A session with one branch is written exactly as before (one sequence's state). With several,
the file's state is the whole memory (`Context.state_get_data`: every cell once, with its set
of sequences - shared cells are saved once) and the header's `extra.branches` lists each
branch: name, sequence id, messages, token mirror, context-shift counters, sampling. Resuming
such a file restores the memory whole and rebuilds every branch; a file written with another
--parallel is refused with one line.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvchat.runtime.errors import KvchatError, SessionError

BRANCH_COMMANDS = {
    "/branch": "/branch NAME: fork the conversation here (shares every cell: nothing is recomputed)",
    "/switch": "/switch NAME: continue another branch",
    "/branches": "the branches, the cells each shares with the current one",
    "/drop": "/drop NAME: remove a branch and free the cells only it holds",
    "/alts": "/alts N: N alternatives of the last answer, decoded together",
    "/pick": "/pick K: keep alternative K (the others' cells are freed)",
}


class BranchCommands:
    """Needs self.branches (kvchat.runtime.chat.branches.Branches), self.conv, self.r, self.engine."""

    def _follow(self) -> None:
        self.conv = self.branches.conv

    def cmd_branch(self, arg: str) -> None:
        self.branches.fork(arg.strip())
        self._follow()
        self.r.notice(
            f"branch {self.branches.current}: forked at {self.conv.n_cached} tokens "
            f"(sequence {self.conv.seq_id}; cells shared, nothing decoded)"
        )

    def cmd_switch(self, arg: str) -> None:
        self.branches.switch(arg.strip())
        self._follow()
        self.r.notice(
            f"on branch {self.branches.current}: {len(self.conv.messages)} messages, "
            f"ctx {self.conv.n_cached}/{self.conv.n_ctx}"
        )

    def cmd_branches(self, arg: str) -> None:
        for name, seq, n_cached, n_msg, shared, prefix, current in self.branches.tree():
            mark = "*" if current else " "
            rel = "" if current else f", shares {shared} cells ({prefix} tokens in common)"
            self.r.notice(f"{mark} {name:<12} seq {seq}: {n_cached} tokens, {n_msg} messages{rel}")

    def cmd_drop(self, arg: str) -> None:
        freed = self.branches.drop(arg.strip())
        self.r.notice(f"dropped {arg.strip()}: {freed} cells freed")

    def cmd_alts(self, arg: str) -> None:
        try:
            n = int(arg.strip())
        except ValueError:
            raise KvchatError("usage: /alts N (N >= 2)") from None
        seed = self.conv.sampler.seed
        from kvchat.cli.chat.setup import sigint_sets

        with sigint_sets(self.conv.stop_event):
            self.conv.stop_event.clear()
            results = self.branches.alternatives(n, seed + 1)
        for k, res in enumerate(results, 1):
            self.r.notice(f"[{k}] (seed {res.seed}, {res.n_gen} tokens, {res.stop})")
            self.r.begin_answer()
            self.r.piece(res.text)
            self.r.end_answer()
        self.r.notice(f"/pick 1..{n} keeps one (showing [1] until then)")

    def cmd_pick(self, arg: str) -> None:
        try:
            k = int(arg.strip())
        except ValueError:
            raise KvchatError("usage: /pick K") from None
        self.branches.pick(k - 1)
        self.r.notice(f"kept alternative {k}; ctx {self.conv.n_cached}/{self.conv.n_ctx}")

    def cmd_kv(self, arg: str) -> None:
        self.r.kv_map(self.engine.ctx.memory, seq_names=self.branches.seq_names())


# ---- session files with every branch ---------------------------------------------------------------


def save_all(path, branches, identity: dict, cache: dict, force: bool = False) -> int:
    """Write a session of every branch (one branch: the plain single-sequence format)."""
    from kvchat.cli.session.session import SessionData, save_conversation, save_session

    conv = branches.conv
    if len(branches.items) == 1:
        return save_conversation(path, conv, identity, cache, force)
    listed = [
        {
            "name": name,
            "seq": c.seq_id,
            "messages": [dict(m) for m in c.messages],
            "tokens": [int(t) for t in c.tokens],
            "n_dropped": int(c.n_dropped),
            "n_keep": int(c.n_keep_shift),
            "sampling": c.sampler.params.to_dict() | {"seed": c.sampler.seed},
        }
        for name, c in branches.items.items()
    ]
    from kvchat.cli.session.session import reasoning_state

    extra = {
        "reasoning": reasoning_state(conv),
        "branches": {
            "current": branches.current,
            "n_seq_max": branches.n_seq_max,
            "kv_unified": bool(getattr(branches.ctx.cparams, "kv_unified", True)),
            "list": listed,
        },
    }
    st = conv.session_state()
    data = SessionData(
        model=identity,
        cache=cache,
        messages=st["messages"],
        sampling=conv.sampler.params.to_dict() | {"seed": conv.sampler.seed},
        tokens=st["tokens"],
        n_dropped=st["n_dropped"],
        n_keep=st["n_keep"],
        state=branches.ctx.state_get_data(),
        extra=extra,
    )
    return save_session(path, data, force)


def _check_listed(info, n_seq_max: int, where: str) -> list:
    if not isinstance(info, dict) or not isinstance(info.get("list"), list) or not info["list"]:
        raise SessionError(f"{where}: invalid branch list")
    if info.get("n_seq_max") != n_seq_max:
        raise SessionError(
            f"{where}: saved with --parallel {info.get('n_seq_max')}, this chat has "
            f"--parallel {n_seq_max} (restart with matching --parallel)"
        )
    seen = set()
    for b in info["list"]:
        ok = (
            isinstance(b, dict)
            and isinstance(b.get("name"), str)
            and isinstance(b.get("seq"), int)
            and 0 <= b["seq"] < n_seq_max
            and isinstance(b.get("messages"), list)
            and isinstance(b.get("tokens"), list)
            and isinstance(b.get("n_dropped"), int)
            and isinstance(b.get("n_keep"), int)
            and isinstance(b.get("sampling"), dict)
            and b["seq"] not in seen
        )
        if not ok:
            raise SessionError(f"{where}: invalid branch entry")
        seen.add(b["seq"])
    if info.get("current") not in {b["name"] for b in info["list"]}:
        raise SessionError(f"{where}: the current branch is not in the list")
    return info["list"]


def load_all(path, branches, identity: dict, cache: dict, n_vocab: int | None = None):
    """Resume a session into `branches` (every branch it holds); returns the SessionData.
    SessionError, and nothing changed, if it does not fit."""
    from kvchat.cli.session.session import load_conversation, load_session
    from kvchat.runtime.chat.branches import clone_conversation
    from kvchat.runtime.sampling import Sampler, SamplingParams

    data = load_session(path, identity, cache, n_vocab)
    info = (data.extra or {}).get("branches")
    base = branches.conv
    if info is None:
        load_conversation(path, base, identity, cache, n_vocab)
        for name in [n for n in branches.items if n != branches.current]:
            branches.ctx.memory.seq_rm(branches.items.pop(name).seq_id, -1, -1)
        return data
    where = str(path)
    listed = _check_listed(info, branches.n_seq_max, where)
    ctx = branches.ctx
    before = ctx.state_get_data()
    if ctx.state_set_data(data.state) != len(data.state):
        ctx.state_set_data(before)
        raise SessionError(f"{where}: the saved memory state does not fit this context (refused)")
    items = {}
    for b in listed:
        c = clone_conversation(base, b["seq"])
        c.messages = [dict(m) for m in b["messages"]]
        c.tokens = [int(t) for t in b["tokens"]]
        c.n_dropped = int(b["n_dropped"])
        c.n_keep_shift = int(b["n_keep"]) if b["n_dropped"] else 0
        c.logits, c._regen, c._n_keep_cache, c._first_prompt_len = None, None, None, 0
        try:
            c.sampler = Sampler(SamplingParams.from_dict(b["sampling"]))
        except (TypeError, ValueError):
            ctx.state_set_data(before)
            raise SessionError(f"{where}: invalid sampling settings of branch {b['name']}") from None
        if ctx.memory.seq_pos_max(c.seq_id) != c.n_cached - 1:
            ctx.state_set_data(before)
            raise SessionError(f"{where}: branch {b['name']}'s tokens do not match its cells (refused)")
        items[b["name"]] = c
    branches.items = items
    branches.current = info["current"]
    branches.pending = None
    return data


def session_path(arg: str) -> Path:
    if not arg:
        raise KvchatError("usage: /save FILE")
    return Path(os.path.expanduser(arg))
