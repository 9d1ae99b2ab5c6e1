"""KL divergence against a base: llama-perplexity's logits file and its statistics.

File (tools/perplexity/perplexity.cpp, `--kl-divergence-base`), little-endian:
    "_logits_"                    8 bytes magic
    n_ctx      i32                tokens per chunk
    n_vocab    i32
    n_chunk    i32
    tokens     i32 [n_chunk * n_ctx]   the text's tokens (first token as in the text, not BOS)
    per chunk, per scored position (n_ctx/2 <= i < n_ctx - 1): one uint16 row of row_words(n_vocab)
    words: the log-probs of the next token at that position (kernels/logprob.py).

`KLDStats` accumulates what llama-perplexity's `--kl-divergence` prints, token by token, and
formats it with its labels and number formats; it also keeps each scored token's KLD, Δp and
depth for the sweep's paired comparisons and depth profile.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import numpy as np

from kvchat.kernels.logprob import kld_rows, row_words
from kvchat.runtime.errors import KvchatError

MAGIC = b"_logits_"
HEADER = struct.Struct("<iii")  # n_ctx, n_vocab, n_chunk after the magic


def n_scored(n_ctx: int) -> int:
    """Positions scored per chunk: n_ctx/2 .. n_ctx-2 (each predicts the token after it)."""
    return n_ctx - 1 - n_ctx // 2


class LogitsFileWriter:
    """Writes a base file to FILE.tmp and renames it on close(): never a half-written FILE."""

    def __init__(self, path, n_ctx: int, n_vocab: int, n_chunk: int, tokens):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, n_vocab, n_chunk
        self.rows_left = n_chunk * n_scored(n_ctx)
        toks = np.asarray(tokens[: n_chunk * n_ctx], dtype="<i4")
        try:
            self.f = open(self.tmp, "wb")
        except OSError as e:
            raise KvchatError(f"cannot write the base file '{path}': {e.strerror}") from None
        self.f.write(MAGIC + HEADER.pack(n_ctx, n_vocab, n_chunk))
        self.f.write(toks.tobytes())

    def write_rows(self, rows: np.ndarray) -> None:
        """rows u16 [n, row_words(n_vocab)]."""
        assert rows.dtype == np.uint16 and rows.shape[1] == row_words(self.n_vocab)
        self.f.write(np.ascontiguousarray(rows, dtype="<u2").tobytes())
        self.rows_left -= rows.shape[0]

    def close(self) -> None:
        self.f.close()
        if self.rows_left != 0:
            raise RuntimeError(f"base file incomplete: {self.rows_left} rows missing")
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


class LogitsFile:
    """A base file opened for reading (rows memory-mapped, checked against the file size)."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8 + HEADER.size)
        except OSError as e:
            raise KvchatError(f"cannot read the base file '{path}': {e.strerror}") from None
        if len(head) < 8 + HEADER.size or head[:8] != MAGIC:
            raise KvchatError(
                f"'{path}' is not a logits base file (no '_logits_' header); write one "
                f"with `kvchat perplexity --kl-divergence-base FILE`"
            )
        self.n_ctx, self.n_vocab, self.n_chunk = HEADER.unpack(head[8:])
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1:
            raise KvchatError(
                f"'{path}': bad header (n_ctx {self.n_ctx}, n_vocab {self.n_vocab}, n_chunk {self.n_chunk})"
            )
        self.nv = row_words(self.n_vocab)
        tok_off = 8 + HEADER.size
        self.rows_off = tok_off + 4 * self.n_ctx * self.n_chunk
        want = self.rows_off + 2 * self.nv * n_scored(self.n_ctx) * self.n_chunk
        if size < want:
            have = max(0, (size - self.rows_off) // (2 * self.nv * n_scored(self.n_ctx)))
            raise KvchatError(
                f"'{path}' is truncated: {size} bytes, {want} expected for {self.n_chunk} "
                f"chunks (only {have} complete); rewrite it"
            )
        self.tokens = np.fromfile(self.path, dtype="<i4", count=self.n_ctx * self.n_chunk, offset=tok_off).astype(
            np.int64
        )
        self._rows = np.memmap(
            self.path, dtype="<u2", mode="r", offset=self.rows_off, shape=(self.n_chunk * n_scored(self.n_ctx), self.nv)
        )

    def chunk_rows(self, i: int) -> np.ndarray:
        """u16 [n_scored, nv] of chunk i (a read-only view)."""
        k = n_scored(self.n_ctx)
        return self._rows[i * k : (i + 1) * k]

    def chunk_tokens(self, i: int) -> np.ndarray:
        return self.tokens[i * self.n_ctx : (i + 1) * self.n_ctx]


def _mean_unc(s: float, s2: float, n: int) -> tuple[float, float]:
    """Mean and its standard error, as llama-perplexity computes them (0 below 11 values)."""
    if n < 1:
        return 0.0, 0.0
    f = s / n
    df = s2 / n - f * f
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


def _percentile(v: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile of sorted float32 values (linear between neighbours)."""
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = np.float32(fraction) * np.float32(v.size - 1)
    ip = int(p)
    p = float(p - ip)
    return (1 - p) * float(v[ip]) + p * float(v[min(ip + 1, v.size - 1)])


def _median(v: np.ndarray) -> float:
    n = v.size
    return float(0.5 * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])


class KLDStats:
    """Running sums of one configuration against a base, token by token."""

    def __init__(self):
        self.sum = np.zeros(10)  # nll, nll2, nll_b, nll_b2, nll*nll_b, kld, kld2, dp, dp2, dp4
        self.max_dp = 0.0
        self.n_same = 0
        self.count = 0
        self.kld: list[np.ndarray] = []  # f32 per scored token, chunk by chunk
        self.dp: list[np.ndarray] = []
        self.depth: list[np.ndarray] = []  # position in its chunk of each scored token
        self.nll: list[np.ndarray] = []
        self.nll_base: list[np.ndarray] = []

    def add_rows(self, logits: np.ndarray, base: np.ndarray, targets: np.ndarray, positions: np.ndarray) -> None:
        """logits f32 [n, n_vocab] of n scored positions, base u16 [n, nv] their base rows,
        targets i64 [n] the tokens they predict, positions i64 [n] their chunk positions."""
        out = np.empty((logits.shape[0], 5))
        kld_rows(logits, np.ascontiguousarray(base), np.ascontiguousarray(targets, dtype=np.int64), out)
        nll, nllb, kld, dp = out[:, 0], out[:, 1], out[:, 2], out[:, 3]
        dp2 = dp * dp
        self.sum += [
            nll.sum(),
            (nll * nll).sum(),
            nllb.sum(),
            (nllb * nllb).sum(),
            (nll * nllb).sum(),
            kld.sum(),
            (kld * kld).sum(),
            dp.sum(),
            dp2.sum(),
            (dp2 * dp2).sum(),
        ]
        if dp.size:
            self.max_dp = max(self.max_dp, float(np.abs(dp).max()))
        self.n_same += int(out[:, 4].sum())
        self.count += out.shape[0]
        self.kld.append(kld.astype(np.float32))
        self.dp.append(dp.astype(np.float32))
        self.depth.append(np.asarray(positions, dtype=np.int64))
        self.nll.append(nll.copy())
        self.nll_base.append(nllb.copy())

    # ---- the numbers --------------------------------------------------------------------------

    def values(self, name: str) -> np.ndarray:
        parts = getattr(self, name)
        return np.concatenate(parts) if parts else np.zeros(0)

    def _log_ppl(self):
        s = self.sum
        a = _mean_unc(s[0], s[1], self.count)
        b = _mean_unc(s[2], s[3], self.count)
        n = self.count
        cov = 0.0 if n < 10 else (s[4] / n - (s[0] / n) * (s[2] / n)) / (n - 1)
        return a, b, cov

    def ppl(self) -> tuple[float, float]:
        (f, df), _, _ = self._log_ppl()
        return math.exp(f), math.exp(f) * df

    def ppl_base(self) -> tuple[float, float]:
        _, (f, df), _ = self._log_ppl()
        return math.exp(f), math.exp(f) * df

    def log_ppl_ratio(self) -> tuple[float, float]:
        (a, da), (b, db), cov = self._log_ppl()
        return a - b, math.sqrt(max(da * da + db * db - 2.0 * cov, 0.0))

    def mean_kld(self) -> tuple[float, float]:
        return _mean_unc(self.sum[5], self.sum[6], self.count)

    def rms_dp(self) -> tuple[float, float]:
        mse, dmse = _mean_unc(self.sum[8], self.sum[9], self.count)
        rms = math.sqrt(mse)
        return rms, (0.5 / rms * dmse if rms > 0 else 0.0)

    def mean_dp(self) -> tuple[float, float]:
        return _mean_unc(self.sum[7], self.sum[8], self.count)

    def same_top(self) -> tuple[float, float]:
        p = self.n_same / self.count if self.count else 0.0
        return p, (math.sqrt(p * (1 - p) / (self.count - 1)) if self.count > 1 else 0.0)

    def summary(self) -> dict:
        """The headline numbers as a flat dict (the sweep's JSON/CSV fields)."""
        kld = np.sort(self.values("kld"))
        mk, dmk = self.mean_kld()
        rms, drms = self.rms_dp()
        st, dst = self.same_top()
        lr, dlr = self.log_ppl_ratio()
        ppl, dppl = self.ppl()
        pb, dpb = self.ppl_base()
        out = dict(
            n_tokens=self.count,
            mean_kld=mk,
            mean_kld_unc=dmk,
            same_top_p=st,
            same_top_p_unc=dst,
            rms_dp=rms,
            rms_dp_unc=drms,
            ppl=ppl,
            ppl_unc=dppl,
            ppl_base=pb,
            ppl_base_unc=dpb,
            ln_ppl_ratio=lr,
            ln_ppl_ratio_unc=dlr,
            ppl_ratio=math.exp(lr),
            ppl_ratio_unc=math.exp(lr) * dlr,
        )
        if kld.size:
            out.update(
                max_kld=float(kld[-1]),
                p99_kld=_percentile(kld, 0.99),
                p999_kld=_percentile(kld, 0.999),
                median_kld=_median(kld),
            )
        return out

    # ---- llama-perplexity's text ----------------------------------------------------------------

    HEADER_LINE = (
        "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
        "              Δp RMS            Same top p"
    )

    def chunk_line(self, i: int) -> str:
        """The per-chunk line llama-perplexity prints after chunk i (0-based), running values."""
        ppl, dppl = self.ppl()
        lr, dlr = self.log_ppl_ratio()
        k, dk = self.mean_kld()
        rms, drms = self.rms_dp()
        st, dst = self.same_top()
        return (
            f"{i + 1:4d}    {ppl:9.4f} ± {dppl:9.4f}    {lr:10.5f} ± {dlr:10.5f}"
            f"    {k:10.5f} ± {dk:10.5f}    {100 * rms:6.3f} ± {100 * drms:6.3f} %"
            f"    {100 * st:6.3f} ± {100 * dst:6.3f} %"
        )

    def report_lines(self) -> list[str]:
        """The closing blocks; empty below 100 scored tokens, as llama-perplexity does."""
        if self.count < 100:
            return []
        kld = np.sort(self.values("kld"))
        dp = np.sort(self.values("dp"))
        (lf, ldf), (bf, bdf), cov = self._log_ppl()
        ppl, dppl = math.exp(lf), math.exp(lf) * ldf
        pb, dpb = math.exp(bf), math.exp(bf) * bdf
        cor = cov / (ldf * bdf) if ldf * bdf else 0.0
        lr, dlr = self.log_ppl_ratio()
        r, dr = math.exp(lr), math.exp(lr) * dlr
        pcov = ppl * pb * cov
        dd = math.sqrt(max(dppl * dppl + dpb * dpb - 2.0 * pcov, 0.0))
        mk, dmk = self.mean_kld()
        md, dmd = self.mean_dp()
        rms, drms = self.rms_dp()
        st, dst = self.same_top()
        P = _percentile
        L = [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {ppl:10.6f} ± {dppl:10.6f}",
            f"Mean PPL(base)                : {pb:10.6f} ± {dpb:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {lr:10.6f} ± {dlr:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {r:10.6f} ± {dr:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {ppl - pb:10.6f} ± {dd:10.6f}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {mk:10.6f} ± {dmk:10.6f}",
            f"Maximum KLD: {float(kld[-1]):10.6f}",
        ]
        for label, fr in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9)):
            L.append(f"{label}   KLD: {P(kld, fr):10.6f}")
        L.append(f"Median  KLD: {_median(kld):10.6f}")
        for label, fr in (("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
            L.append(f"{label}   KLD: {P(kld, fr):10.6f}")
        L += [
            f"Minimum KLD: {float(kld[0]):10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * md:6.3f} ± {100 * dmd:5.3f} %",
            f"Maximum Δp: {100 * float(dp[-1]):6.3f}%",
        ]
        for label, fr in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9), ("75.0%", 0.75)):
            L.append(f"{label}   Δp: {100 * P(dp, fr):6.3f}%")
        L.append(f"Median  Δp: {100 * _median(dp):6.3f}%")
        for label, fr in (("25.0%", 0.25), ("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
            L.append(f"{label}   Δp: {100 * P(dp, fr):6.3f}%")
        L += [
            f"Minimum Δp: {100 * float(dp[0]):6.3f}%",
            f"RMS Δp    : {100 * rms:6.3f} ± {100 * drms:5.3f} %",
            f"Same top p: {100 * st:6.3f} ± {100 * dst:5.3f} %",
        ]
        return L
