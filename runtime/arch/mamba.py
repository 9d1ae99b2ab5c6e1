"""mamba (src/models/mamba.cpp + graph-context-mamba.cpp build_mamba_layer): Mamba-1.

Per layer: x += out_proj(y) of h = RMSNorm(x), where
    x_in, z = split(in_proj(h))                          (d_inner each)
    u  = silu(conv1d(x_in) + conv_bias)                  causal, continuing the conv state
    dt, B, C = split(x_proj(u))                          (dt_rank, d_state, d_state)
    dt = dt_proj(dt) + dt_bias                           softplus is applied inside the scan
    y  = (scan(u, dt, A, B, C) + D * u) * silu(z)        A = -exp(A_log), stored so in GGUF
Every layer is x += mixer(attn_norm(x)), no FFN (the layer loop of runtime/arch/layer_plan.py).
Memory: a recurrent memory (conv state [d_inner, d_conv - 1], SSM state [d_inner, d_state]).
llama.cpp accepts only d_inner = 2 * n_embd; the B/C/dt RMS norms (FalconMamba) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvchat.kernels.ssm_scan import scan
from kvchat.runtime.arch.base import Arch, Tensor
from kvchat.runtime.arch.layer_plan import LayerSpec
from kvchat.runtime.arch.recurrent_blocks import causal_conv, create_recurrent_memory, dense, silu
from kvchat.runtime.hparams import MAX_DIM, HParams, read_common, scalar_int


@dataclass
class MambaHParams(HParams):
    d_conv: int = 4
    d_inner: int = 0
    d_state: int = 16
    dt_rank: int = 0

    def is_recurrent(self, il: int) -> bool:
        return 0 <= il < self.n_layer

    def has_kv(self, il: int) -> bool:
        return False

    def n_embd_r(self) -> int:
        return (self.d_conv - 1) * self.d_inner

    def n_embd_s(self) -> int:
        return self.d_state * self.d_inner


def mamba_layer(hp, L, h, rctx, il, min_macs: int | None = None) -> np.ndarray:
    """h f32 [n_tokens, n_embd] -> f32 [n_tokens, n_embd]; min_macs: the step's matmul threshold."""
    d_inner, d_state, dt_rank = hp.d_inner, hp.d_state, hp.dt_rank
    n_rs, n = rctx.get_n_rs(), h.shape[0]
    xz = L.ssm_in.matmul(h, min_macs)  # [n, 2 * d_inner]
    u = causal_conv(rctx, il, np.ascontiguousarray(xz[:, :d_inner]), dense(L, "ssm_conv1d"), hp.d_conv)
    u = silu(u + L.ssm_conv1d_b)  # [n, d_inner]
    x_db = L.ssm_x.matmul(u, min_macs)  # [n, dt_rank + 2 * d_state]
    dt = L.ssm_dt.matmul(np.ascontiguousarray(x_db[:, :dt_rank]), min_macs) + L.ssm_dt_b  # [n, d_inner]
    B, C = x_db[:, dt_rank : dt_rank + d_state], x_db[:, dt_rank + d_state :]
    s0 = rctx.get_s(il).reshape(n_rs, d_inner, d_state)
    shp = (n_rs, n // n_rs)
    y, s1 = scan(
        s0,
        u.reshape(*shp, d_inner),
        dt.reshape(*shp, d_inner),
        dense(L, "ssm_a"),
        B.reshape(*shp, d_state),
        C.reshape(*shp, d_state),
    )
    rctx.cpy_s(il, s1.reshape(n_rs, -1))
    y = y.reshape(n, d_inner) + u * L.ssm_d
    return L.ssm_out.matmul(np.ascontiguousarray(y * silu(np.ascontiguousarray(xz[:, d_inner:]))), min_macs)


def mamba_mixer(p, h, pos, mctx, run) -> np.ndarray:
    """The layer loop's mixer: mctx is the recurrent memory's context."""
    return mamba_layer(p.hp, p.L, h, mctx, p.il, run.min_macs)


MAMBA_LAYER = LayerSpec(mixer=mamba_mixer, project=False, ffn=None)  # x += mixer(norm(x)), no FFN


class Mamba(Arch):
    name = "mamba"
    fusions = ()

    def read_common(self, gf) -> dict:
        return read_common(gf, self, given={"n_ff": 0, "n_head": 1, "n_head_kv": 1})

    def read_hparams(self, gf, fields) -> MambaHParams:
        k = lambda name: f"mamba.{name}"  # noqa: E731
        hp = MambaHParams(
            **fields,
            d_conv=scalar_int(gf, k("ssm.conv_kernel"), 2, 64),
            d_inner=scalar_int(gf, k("ssm.inner_size"), 1, MAX_DIM),
            d_state=scalar_int(gf, k("ssm.state_size"), 1, MAX_DIM),
            dt_rank=scalar_int(gf, k("ssm.time_step_rank"), 1, MAX_DIM),
        )
        if hp.d_inner != 2 * hp.n_embd:
            gf.fail(k("ssm.inner_size"), f"{hp.d_inner}: only d_inner = 2 * n_embd is supported")
        if gf.metadata.get(k("ssm.dt_b_c_rms")):
            gf.fail(k("ssm.dt_b_c_rms"), "RMS norms on dt/B/C (FalconMamba) are not supported")
        return hp

    def layer_tensors(self, hp, il):
        e, di, ds, dr, dc = hp.n_embd, hp.d_inner, hp.d_state, hp.dt_rank, hp.d_conv
        p = f"blk.{il}."
        return {
            "attn_norm": Tensor(p + "attn_norm.weight", (e,)),
            "ssm_in": Tensor(p + "ssm_in.weight", (e, 2 * di)),
            "ssm_conv1d": Tensor(p + "ssm_conv1d.weight", (dc, di)),
            "ssm_conv1d_b": Tensor(p + "ssm_conv1d.bias", (di,)),
            "ssm_x": Tensor(p + "ssm_x.weight", (di, dr + 2 * ds)),
            "ssm_dt": Tensor(p + "ssm_dt.weight", (dr, di)),
            "ssm_dt_b": Tensor(p + "ssm_dt.bias", (di,)),
            "ssm_a": Tensor(p + "ssm_a", (ds, di)),
            "ssm_d": Tensor(p + "ssm_d", (di,)),
            "ssm_out": Tensor(p + "ssm_out.weight", (di, e)),
        }

    def layer_spec(self, hp, il):
        return MAMBA_LAYER

    def create_memory(self, hparams, cparams):
        return create_recurrent_memory(hparams, cparams)


ARCH = Mamba()
