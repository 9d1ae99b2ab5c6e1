"""The inference context (llama_context): decode(), outputs, state, memory reporting.

decode(batch) either fully succeeds or leaves memory as it was:
  1. BatchAllocator.init validates and completes the batch            (invalid -> -1)
  2. pending memory updates (K-shift, stream copies) are applied
  3. memory.init_batch splits it and finds slots in a dry run; on FAILED_PREPARE one retry
     after pending updates                                            (no room -> 1, untouched)
  4. per ubatch: mctx.apply() (the only mutation), abort check, model.forward(ubatch, mctx)
     -> logits rows of the ubatch's outputs, mctx.next()
  5. any failure after an apply() rolls back everything this call placed   (2 / -2 / -3)
decode_one(token, pos, seq) is the same for one generated token, chosen once by its caller
(runtime/generate.py; gpt-fast's decode_one_token): step 1 on Python scalars (batch.OneToken,
whose splits hand the memory its one ubatch) and, in step 4, the matmul threshold the launch
tuner picks for the step (kernels/launch_tuner.py); steps 2, 3 and 5 are decode's own.
The model is anything with `.hparams` and `.forward(ubatch, mctx, min_macs=None) -> f32 [n_outputs,
n_vocab]` (min_macs: the matmul threshold of a one-token step, given by the launch tuner).
"""

from __future__ import annotations

import logging

import numpy as np

from kvchat.kernels.launch_tuner import PARALLEL, SERIAL, LaunchTuner
from kvchat.runtime.arch import create_memory
from kvchat.runtime.batch import Batch, BatchAllocator, OneToken
from kvchat.runtime.cparams import ContextParams, resolve_cparams
from kvchat.runtime.memory.interface import MemoryStatus

log = logging.getLogger(__name__)

STATE_SEQ_MAGIC = 0xAF143CD8  # llama.cpp's io_magic at the head of a sequence state blob
SERIAL_STEP_MACS = 1 << 62  # decode_tuned on the SERIAL arm: every matmul on its serial twin
# decode_tuned: a larger batch (a draft model's catch-up on a prompt) is a prompt's work, run as
# decode() runs prompts: a tuner still on its first SERIAL arm ran a 561-token draft prefill on one thread
TUNED_MAX_TOKENS = 32
_ROW0 = np.zeros(1, dtype=np.int64)  # out_row of decode_one's token: output row 0 (read only)
_ROW0.flags.writeable = False


class DecodeAborted(Exception):
    """Raised by a forward pass (or seen by Context) when the abort callback asked to stop."""


class Context:
    """One model + one memory + the outputs of the last decode."""

    def __init__(self, model, params: ContextParams | None = None, abort_callback=None, memory=None):
        """memory: another Context's memory to read and write instead of a new one (a self-draft
        works in its target's memory: runtime/speculative/self_draft.py); the caller vouches that
        it was made for these hyper-parameters and params."""
        self.model = model
        self.hparams = model.hparams
        self.params = params or ContextParams()
        self.cparams = resolve_cparams(self.params, self.hparams)
        self.memory = create_memory(self.hparams, self.cparams) if memory is None else memory
        self.abort_callback = abort_callback
        self.balloc = BatchAllocator()
        self.one = OneToken()  # decode_one's allocator
        self.n_vocab = int(self.hparams.n_vocab)
        self.last_error = ""
        self._logits = np.zeros((0, self.n_vocab), dtype=np.float32)  # [n_outputs, n_vocab]
        self._n_outputs = 0
        self._out_row = np.zeros(0, dtype=np.int64)  # batch index -> output row (-1: none)
        self.n_threads = self.cparams.n_threads
        self.launch = LaunchTuner()  # decode_one's steps: layer matmuls on one core or all (measured)
        if self.n_threads is not None:
            self.set_n_threads(self.n_threads)

    # ---- properties -------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.cparams.n_ctx

    @property
    def n_ctx_seq(self) -> int:
        return self.cparams.n_ctx_seq

    @property
    def n_batch(self) -> int:
        return self.cparams.n_batch

    @property
    def n_ubatch(self) -> int:
        return self.cparams.n_ubatch

    def set_n_threads(self, n: int) -> None:
        import numba

        n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(n)
        self.n_threads = n

    # ---- decode -----------------------------------------------------------------------------

    def memory_update(self, optimize: bool = False) -> bool:
        """Apply pending memory updates; True if something was done."""
        mctx = self.memory.init_update(optimize)
        st = mctx.get_status()
        if st == MemoryStatus.NO_UPDATE:
            return False
        if st != MemoryStatus.SUCCESS:
            log.error("failed to prepare memory update")
            return False
        return bool(mctx.apply())

    def _fail(self, code: int, msg: str) -> int:
        self.last_error = msg
        (log.warning if code == 1 else log.error)("decode: %s", msg)
        return code

    def decode(self, batch: Batch) -> int:
        """0 ok; 1 no memory slot (memory untouched); 2 aborted; -1 invalid batch;
        -2 allocation / memory failure; -3 compute failure. 2/-2/-3 leave memory as before."""
        return self._decode_checked(batch, self.model.forward)

    def _decode_checked(self, batch: Batch, forward) -> int:
        self.last_error = ""
        if batch.n_tokens == 0:
            return self._fail(-1, "n_tokens == 0")
        if batch.n_tokens > self.cparams.n_batch:
            return self._fail(-1, f"batch of {batch.n_tokens} tokens exceeds n_batch = {self.cparams.n_batch}")
        balloc = self.balloc
        if not balloc.init(batch, self.n_vocab, self.cparams.n_seq_max, self.memory):
            return self._fail(-1, balloc.error)
        out_row = np.cumsum(balloc.output) - 1  # batch index -> output row
        out_row[~balloc.output] = -1
        return self._decode_split(balloc, out_row, forward)

    def decode_tuned(self, batch: Batch) -> int:
        """decode(batch) for a small batch generated one sequence at a time (a speculative
        verify: the sampled token and its drafts), on the arm the launch tuner chose for the
        one-token steps around it (kernels/launch_tuner.py): on SERIAL every kernel of the step
        runs on this thread (numba's thread count 1 for the call, matmuls on their serial twins);
        a few rows are too little work for a parallel launch, which under load waits for a
        descheduled worker (SmolLM2 Q8_0, 8 rows, loaded machine: 165 -> 90 ms). On PARALLEL the
        matmuls take that arm's threshold, as the one-token steps do: decode()'s configured one
        (4M multiply-adds) ran every matmul of a few-row SmolLM2 F16 batch on one thread, a
        one-row verify 1.5x a one-token step. Same bits either way (every kernel's serial and
        parallel twins are array_equal); nothing is timed for the tuner."""
        if not self.launch.enabled or batch.n_tokens > TUNED_MAX_TOKENS:
            return self.decode(batch)
        if self.launch.arm != SERIAL:
            return self._decode_checked(batch, self._parallel_forward)
        import numba

        n_threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            return self._decode_checked(batch, self._serial_forward)
        finally:
            numba.set_num_threads(n_threads)

    def _serial_forward(self, ub, mctx):
        return self.model.forward(ub, mctx, min_macs=SERIAL_STEP_MACS)

    def _parallel_forward(self, ub, mctx):
        return self.model.forward(ub, mctx, min_macs=LaunchTuner.min_macs(PARALLEL))

    def decode_one(self, token: int, pos: int, seq: int = 0) -> int:
        """decode(Batch.one_seq([token], pos, seq)) for a generated token: the same return code,
        error, logits row and memory state (tests/test_batch_one_token.py), without the general
        allocator's passes, and with the launch tuner's matmul threshold for the step."""
        self.last_error = ""
        one = self.one
        if not one.init(int(token), int(pos), int(seq), self.n_vocab, self.cparams.n_seq_max, self.memory):
            return self._fail(-1, one.error)
        return self._decode_split(one, _ROW0, self._tuned_forward)

    def _tuned_forward(self, ub, mctx):
        return self.launch.forward(self.model, ub, mctx)

    def _decode_split(self, balloc, out_row: np.ndarray, forward) -> int:
        """Steps 2-5 of decode (module docstring) for a validated allocator: slots, then per
        ubatch apply, forward(ub, mctx), output rows; out_row: batch index -> output row (-1: none)."""
        self.memory_update(False)

        did_optimize = False
        while True:
            mctx = self.memory.init_batch(balloc, self.cparams.n_ubatch)
            st = mctx.get_status()
            if st == MemoryStatus.SUCCESS:
                break
            if st == MemoryStatus.FAILED_PREPARE:
                # llama.cpp retries once after a memory "optimize" update. Compaction only
                # permutes cells - the number of usable cells, and so whether the batch fits,
                # cannot change - so the retry applies pending updates only, and a refused
                # batch leaves every cell where it was.
                if not did_optimize:
                    did_optimize = True
                    if self.memory_update(False):
                        continue
                return self._fail(1, f"failed to find a memory slot for batch of size {balloc.get_n_tokens()}")
            return self._fail(-2, f"unexpected memory context status {st.name}")

        n_out = balloc.get_n_outputs()
        if self._logits.shape[0] < n_out:
            self._logits = np.empty((n_out, self.n_vocab), dtype=np.float32)
        self._n_outputs = 0  # outputs are invalid until the call succeeds

        code = 0
        try:
            while True:
                ub = mctx.get_ubatch()
                mctx.apply()
                if self.abort_callback is not None and self.abort_callback():
                    raise DecodeAborted()
                logits = forward(ub, mctx)
                if ub.n_outputs:
                    rows = out_row[ub.batch_idx[ub.output]]
                    self._logits[rows] = logits[: ub.n_outputs]
                if not mctx.next():
                    break
        except DecodeAborted:
            code = 2
            self.last_error = "decode aborted by the abort callback"
        except MemoryError as e:
            code = -2
            self.last_error = f"out of memory during decode: {e}"
        except Exception as e:  # a compute failure: report it, undo, return -3
            log.exception("decode: compute failed")
            code = -3
            self.last_error = f"compute failed: {type(e).__name__}: {e}"
        except BaseException:
            mctx.rollback()  # KeyboardInterrupt & co: memory stays consistent, then re-raise
            raise
        if code != 0:
            mctx.rollback()
            # an abort is the caller's own request (Ctrl-C, a reader gone): nothing to warn about
            (log.debug if code == 2 else log.warning)(
                "decode: %s - removed this call's entries from memory", self.last_error
            )
            return code

        self._n_outputs = n_out
        self._out_row = out_row
        return 0

    # ---- outputs ----------------------------------------------------------------------------

    def get_logits(self) -> np.ndarray:
        """f32 [n_outputs, n_vocab]: the output rows of the last decode, in batch order."""
        return self._logits[: self._n_outputs]

    def get_logits_ith(self, i: int) -> np.ndarray:
        """f32 [n_vocab]: logits of batch token i (must be an output); i < 0 counts from the
        end of the outputs (-1 = last output)."""
        if i < 0:
            j = self._n_outputs + i
            if j < 0:
                raise IndexError(f"output index {i} out of range ({self._n_outputs} outputs)")
            return self._logits[j]
        if i >= self._out_row.shape[0]:
            raise IndexError(f"token index {i} out of range ({self._out_row.shape[0]} tokens)")
        j = int(self._out_row[i])
        if j < 0 or j >= self._n_outputs:
            raise IndexError(f"token {i} has no logits (it was not flagged as an output)")
        return self._logits[j]

    @property
    def n_outputs(self) -> int:
        return self._n_outputs

    # ---- memory reporting -------------------------------------------------------------------

    def memory_breakdown(self) -> dict:
        """Bytes per buffer: the memory's K/V (per cache) plus the logits output buffer."""
        mem = self.memory.memory_breakdown()
        out_bytes = int(self._logits.nbytes)
        return {"memory": mem, "output_bytes": out_bytes, "total_bytes": int(mem["total_bytes"]) + out_bytes}

    # ---- state ------------------------------------------------------------------------------

    def state_get_data(self) -> bytes:
        """The whole memory state: model arch, then every stream's cells and K/V rows."""
        from kvchat.runtime.memory.state import StateWriter

        io = StateWriter()
        io.write_string(str(self.hparams.arch))
        self.memory.state_write(io, -1)
        return io.getvalue()

    def state_set_data(self, blob: bytes) -> int:
        """Restore a state_get_data blob; bytes read, or 0 if refused (memory unchanged)."""
        from kvchat.runtime.memory.state import StateError, StateReader

        io = StateReader(blob)
        try:
            arch = io.read_string()
            if arch != str(self.hparams.arch):
                raise StateError(f"wrong model arch: '{arch}' instead of '{self.hparams.arch}'")
            parsed = self.memory.state_parse(io, -1)
            io.expect_end()  # all checks pass before anything changes
            self.memory.state_apply(parsed, -1)
        except StateError as e:
            self.last_error = f"error loading state: {e}"
            log.error("%s", self.last_error)
            return 0
        return io.n_read

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """One sequence's state (its SWA-visible cells and their K/V rows)."""
        from kvchat.runtime.memory.state import StateWriter

        io = StateWriter()
        io.write_u32(STATE_SEQ_MAGIC)
        io.write_i32(seq_id)
        self.memory.state_write(io, seq_id)
        return io.getvalue()

    def state_seq_set_data(self, blob: bytes, seq_id: int) -> int:
        """Restore a sequence state into seq_id; bytes read, or 0 if refused (memory unchanged)."""
        from kvchat.runtime.memory.state import StateError, StateReader

        io = StateReader(blob)
        try:
            if not 0 <= seq_id < self.cparams.n_seq_max:
                raise StateError(f"seq_id {seq_id} out of range [0, {self.cparams.n_seq_max})")
            if io.read_u32() != STATE_SEQ_MAGIC:
                raise StateError("wrong sequence state magic")
            io.read_i32()  # the saved seq id: restored into seq_id instead
            parsed = self.memory.state_parse(io, seq_id)
            io.expect_end()
            self.memory.state_apply(parsed, seq_id)
        except StateError as e:
            self.last_error = f"error loading sequence state: {e}"
            log.error("%s", self.last_error)
            return 0
        return io.n_read
