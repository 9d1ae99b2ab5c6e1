"""gpt-oss (attention sinks, iSWA with alternating sliding / full layers, YaRN RoPE, Q/K/V/O biases,
softmax over the selected top-k, expert biases, clamped SwiGLU; MXFP4 experts) against llama.cpp on
the tiny seeded models of tests/helpers/moe_models.py (refs in tests/moe_refs/)."""

import numpy as np

from kvchat.runtime.model import Model
from tests.helpers import arch_refs
from tests.helpers.arch_refs import MARGIN


class TestAgainstLlamaCpp(arch_refs.ReferenceChecks):
    name = "gpt_oss_s1"  # F32, 8 experts top-2, head size 32, window 16 on layers 0 and 2
    chat_name = "gpt_oss_s1_chat"


def _top_delta(ref_top, row) -> float:
    return max(abs(float(row[t]) - lp) for t, lp in ref_top)


class TestMXFP4AgainstLlamaCpp(arch_refs.ReferenceChecks):
    """MXFP4 experts: the activations reach them quantized to q8_0 (ggml's vec_dot_type), so a
    last-bit difference upstream can move a quantization step. llama.cpp itself answers differently
    at two positions of the long prompt depending on its ubatch size (one batch vs one token per
    ubatch: 0.032 and 0.037); there the reference is either of its answers."""

    name = "gpt_oss_s2_mxfp4"  # 16 experts top-4, head size 16, 6 heads / 2 kv, window 8
    chat_name = "gpt_oss_s2_mxfp4_chat"

    def test_logprobs_match_llama_cpp_on_every_reference_prompt(self, tmp_path):
        ref = arch_refs.load_ref(self.name)
        m = Model.load(arch_refs.model_path(self.name))
        own_disagreements = 0
        try:
            for entry in ref["logits"]:
                lp = arch_refs.log_softmax(arch_refs.all_logits(m, entry["tokens"]))
                for i, (batched, one) in enumerate(zip(entry["positions"], entry["positions_ubatch1"])):
                    d = min(_top_delta(batched["top"], lp[i]), _top_delta(one["top"], lp[i]))
                    assert d <= 1e-3, f"{entry['name']} position {i}: max |Δ log-prob| {d:.2e}"
                    if _top_delta(batched["top"], lp[i]) > 1e-3:  # only where llama.cpp disagrees with itself
                        assert max(abs(a[1] - b[1]) for a, b in zip(batched["top"], one["top"])) > 1e-3
                        own_disagreements += 1
                    top = batched["top"]
                    if top[0][1] - top[1][1] > MARGIN:
                        assert int(np.argmax(lp[i])) in (top[0][0], one["top"][0][0]), f"{entry['name']} {i}"
        finally:
            m.close()
        assert own_disagreements <= 2

    def test_a_q8_0_copy_runs_through_chat_and_run(self, tmp_path, capsys, monkeypatch):
        """Its MXFP4 experts are the quantized copy here: it chats through `run` and `chat` as it is."""
        arch_refs.check_chat_and_run_q8(self.chat_name, tmp_path, capsys, monkeypatch, copy=False)


def test_sinks_and_yarn_decide_the_outputs():
    """Without the attention sinks, or with plain RoPE in place of YaRN, the long prompt's log-probs
    leave llama.cpp's by far more than the tolerance: the references see both."""
    ref = arch_refs.load_ref("gpt_oss_s1")
    entry = next(e for e in ref["logits"] if e["name"] == "long")
    for change in ("sinks", "yarn"):
        m = Model.load(arch_refs.model_path("gpt_oss_s1"))
        try:
            assert m.hparams.rope_scaling_type == "yarn" and m.hparams.swa_layers == [True, False, True]
            if change == "sinks":
                for layer in m.weights.layers:
                    layer.attn_sinks = np.full_like(layer.attn_sinks, -np.inf)  # exp(-inf) = 0: no sink
            else:
                m.hparams.rope_scaling_type = "linear"
            lp = arch_refs.log_softmax(arch_refs.all_logits(m, entry["tokens"]))
        finally:
            m.close()
        ours = [[(int(t), float(r[t])) for t in np.argsort(-r)] for r in lp]
        d, _ = arch_refs.compare_entry(entry, ours)
        assert d > 0.05, change


def test_info_shows_gpt_oss_experts_and_the_mxfp4_bytes_a_token_reads():
    from kvchat.cli.commands.info import model_rows
    from kvchat.runtime.arch import read_hparams
    from kvchat.runtime.arch.moe import token_read_bytes
    from kvchat.runtime.gguf.file import GGUFFile

    gf = GGUFFile(arch_refs.model_path("gpt_oss_s2_mxfp4"))
    try:
        hp = read_hparams(gf)
        experts = 2 * (2 * 16 * 96 * 64 + 16 * 64 * 96) // 32 * 17  # layers x (gate, up, down) MXFP4 blocks
        assert sum(t.nbytes for t in gf.tensors.values() if t.name.endswith("_exps.weight")) == experts
        biases = 2 * 16 * (96 + 96 + 64) * 4  # per-expert biases, F32
        total = sum(t.nbytes for t in gf.tensors.values())
        embd = 287 * 64 * 4  # F32 token_embd: a token reads its row (the head is output.weight)
        assert token_read_bytes(gf, hp) == total - (experts + biases) * 12 // 16 - embd + 64 * 4  # 4 of 16 experts
        rows = dict(model_rows(gf, hp))
    finally:
        gf.close()
    assert rows["experts"].startswith("16 (4 used a token, no shared expert), expert FFN 96, gating softmax_weight")


def test_yarn_rope_is_ggmls_rope_yarn_in_float64():
    """kernels/rope.py with YaRN's arguments (HParams.rope_args of a gpt-oss file) against ggml's
    rope_yarn written out in float64: corr dims from beta_fast 32 / beta_slow 1, the per-pair ramp,
    interp * (1 - ramp) + extrap * ramp, and the magnitude 1 + 0.1 ln(1 / freq_scale) on cos and sin."""
    from kvchat.kernels.rope import rope_inplace

    m = Model.load(arch_refs.model_path("gpt_oss_s1"))
    try:
        hp = m.hparams
        args = hp.rope_args(0, 2048)
    finally:
        m.close()
    n_rot, base, fs, n_orig = hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.n_ctx_orig
    assert (n_rot, base, fs, n_orig) == (32, 150000.0, 1 / 32, 64)

    def corr(beta):
        return n_rot * np.log(n_orig / (beta * 2 * np.pi)) / (2 * np.log(base))

    lo, hi = max(0.0, np.floor(corr(32.0))), min(n_rot - 1.0, np.ceil(corr(1.0)))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 4, 32)).astype(np.float32)
    pos = np.array([0, 1, 17, 63, 1000], np.int32)
    got = x.copy()
    rope_inplace(got, pos, neox=True, **args)
    half = n_rot // 2
    i = np.arange(half)
    ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
    extrap = pos[:, None].astype(np.float64) * base ** (-2.0 * i / n_rot)  # [n, half]
    theta = fs * extrap * (1 - ramp) + extrap * ramp
    mscale = 1 + 0.1 * np.log(1 / fs)
    c, s = np.cos(theta)[:, None] * mscale, np.sin(theta)[:, None] * mscale
    a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    want = np.concatenate([a * c - b * s, a * s + b * c], -1)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    assert ramp[0] == 1 and ramp[-1] == 0  # both ends of the ramp are used


def test_a_gpt_oss_file_without_its_sliding_window_is_a_one_line_error(tmp_path):
    from tests.helpers.cli_inproc import kvchat
    from tests.helpers.gguf_factory import write_tiny_model

    p = write_tiny_model(tmp_path / "oss.gguf", arch="gpt-oss", n_embd=64, n_head=4, n_head_kv=2, tied=False)
    r = kvchat("info", "-m", p)
    assert r.returncode == 1  # (info shows the file's general rows first)
    assert r.stderr == f"error: {p}: gpt-oss.attention.sliding_window: missing (required)\n"
