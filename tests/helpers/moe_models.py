"""The tiny seeded mixture-of-experts models that tests/moe_refs/ holds llama.cpp's outputs for.

Each model is written on demand by tests/gguf_factory.py (bit-reproducible from its seed, so
only llama.cpp's outputs are kept in the repository: tests/moe_refs/refs_<name>.json, made by
`python -m tests.helpers.moe_models --moeref PATH/TO/moeref`, a small C++ program against libllama:
see tests/moe_refs/README.md). F32 weights, the factory's byte-level BPE vocabulary, tied head.
The final norm is ~N(6, 0.3) so that the distributions are peaked (the outputs then depend
strongly on the attention and on which experts a token is routed to).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REFS = Path(__file__).parent.parent / "moe_refs"

PROMPTS = {
    "short": "Once upon a time",
    "chat": "<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n",
    "long": (
        "The GNU General Public License is a free, copyleft license for software and other kinds of works. "
        "The licenses for most software and other practical works are designed to take away your freedom "
        "to share and change the works. By contrast, the GNU General Public License is intended to guarantee "
        "your freedom to share and change all versions of a program--to make sure it remains free software."
    ),
}

GPT_OSS_META = {
    "gpt-oss.attention.sliding_window": 16,
    "gpt-oss.rope.scaling.type": "yarn",
    "gpt-oss.rope.scaling.factor": 32.0,
    "gpt-oss.rope.scaling.original_context_length": 64,
    "gpt-oss.rope.freq_base": 150000.0,
}

# name -> write_tiny_model arguments (small dims, 8-16 experts, top-2..4, head sizes that are not
# n_embd / n_head, widths that are not multiples of 32; kvchat's attention takes head sizes in multiples of 16)
MODELS = {
    "qwen3moe_s1": dict(
        arch="qwen3moe", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=96,
        n_expert=8, n_expert_used=2, n_ff_exp=64, seed=1,
    ),
    "qwen3moe_s2": dict(
        arch="qwen3moe", n_layer=2, n_embd=48, n_head=3, n_head_kv=1, head_dim=16, n_ff=64,
        n_expert=16, n_expert_used=4, n_ff_exp=40, seed=2,
    ),
    "olmoe_s1": dict(
        arch="olmoe", n_layer=3, n_embd=64, n_head=4, n_head_kv=4, n_ff=64, tied=False,
        n_expert=16, n_expert_used=4, n_ff_exp=64, seed=3,
    ),
    "granitemoe_s1": dict(
        arch="granitemoe", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=64,
        n_expert=8, n_expert_used=3, n_ff_exp=64, n_ff_shexp=48, seed=4,
        metadata={"granitemoe.logit_scale": 0.5, "granitemoe.embedding_scale": 2.0,
                  "granitemoe.residual_scale": 0.5, "granitemoe.attention.scale": 0.2},
    ),
    # gpt-oss: iSWA (layers 0, 2 slide over 16 cells), YaRN (factor 32 over an original context of
    # 64), Q/K/V/O biases, sinks ~N(0, 2) per head, router and expert biases, clamped SwiGLU; s2's experts are MXFP4
    "gpt_oss_s1": dict(
        arch="gpt-oss", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=64, tied=False,
        qkv_bias=True, n_expert=8, n_expert_used=2, n_ff_exp=64, seed=6, sinks=2.0, metadata=GPT_OSS_META,
    ),
    "gpt_oss_s2_mxfp4": dict(
        arch="gpt-oss", n_layer=2, n_embd=64, n_head=6, n_head_kv=2, head_dim=16, n_ff=96, tied=False,
        qkv_bias=True, n_expert=16, n_expert_used=4, n_ff_exp=96, seed=7, sinks=2.0, experts="mxfp4",
        metadata=dict(GPT_OSS_META, **{"gpt-oss.attention.sliding_window": 8}),
    ),
    # the shared qwen35_s1 (hybrid: delta-net layers 0-2, gated attention layer 3; SmolLM2's
    # tokenizer) with its dense FFNs replaced by MoE FFNs + gated shared experts
    "qwen35moe_s1": dict(derive="qwen35_s1", arch="qwen35moe", n_expert=8, n_expert_used=2, n_ff_exp=64,
                         n_ff_shexp=32, seed=5),
}  # fmt: skip
# the same models saying only printable tokens (output.weight from the factory's output_tokens): what
# `kvchat run` prints of them equals the detokenized ids, so the chat/run checks use these (no refs)
CHAT_MODELS = {f"{name}_chat": dict(kw, printable=True) for name, kw in MODELS.items()}


def write_model(name: str, path) -> Path:
    """Model `name` of MODELS at `path` (the same bytes every time)."""
    from tests.helpers.gguf_factory import write_tiny_model

    kw = dict(MODELS.get(name) or CHAT_MODELS[name])
    if "derive" in kw:
        return derive_moe(kw, path)
    extra = dict(kw.pop("extra", {}))
    if kw.pop("printable", False):
        from tests.helpers.gguf_factory import printable_token_ids

        kw["output_tokens"] = printable_token_ids()
    rng = np.random.default_rng(1000 + kw["seed"])
    extra["output_norm.weight"] = (6.0 + 0.3 * rng.standard_normal(kw["n_embd"])).astype(np.float32)
    drop = ["output_norm.weight"]
    sinks = kw.pop("sinks", None)  # attention sinks ~N(0, sinks) per head, in place of the factory's ~0
    for il in range(kw["n_layer"] if sinks else 0):
        drop.append(f"blk.{il}.attn_sinks.weight")
        extra[drop[-1]] = (sinks * rng.standard_normal(kw["n_head"])).astype(np.float32)
    experts = kw.pop("experts", None)  # "mxfp4": the stacked experts quantized by gguf-py, the rest F32
    out = Path(path) if experts is None else Path(str(path) + ".f32")
    write_tiny_model(out, norm_eps=1e-5, drop_tensors=tuple(drop), extra_tensors=extra, **dict(RAW_DEFAULTS, **kw))
    if experts is None:
        return out
    from kvchat.kernels.ggml_types import GGMLType
    from tests.helpers.gguf_factory import quantized_copy

    quantized_copy(out, path, GGMLType[experts.upper()], only=lambda name: name.endswith("_exps.weight"))
    out.unlink()
    return Path(path)


RAW_DEFAULTS = dict(rope_freq_base=10000.0)  # what a model's metadata does not say


def derive_moe(kw: dict, path) -> Path:
    """A shared reference model (shared/reference/tiny/<derive>.gguf) re-written as the MoE
    architecture kw["arch"]: every key renamed, each layer's ffn_{gate,up,down} replaced by a
    seeded router, stacked experts and a gated shared expert (N(0, 1/fan_in), F32)."""
    import gguf

    from tests.helpers.arch_refs import TINY

    src = TINY / f"{kw['derive']}.gguf"
    r = gguf.GGUFReader(str(src))
    old, arch = r.fields["general.architecture"].contents(), kw["arch"]
    w = gguf.GGUFWriter(str(path), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key.replace(f"{old}.", f"{arch}.", 1), f.contents(), vt, sub_type=sub)
    n, k, ff, fs = kw["n_expert"], kw["n_expert_used"], kw["n_ff_exp"], kw["n_ff_shexp"]
    for key, value in (("expert_count", n), ("expert_used_count", k), ("expert_feed_forward_length", ff),
                       ("expert_shared_feed_forward_length", fs)):  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    rng = np.random.default_rng(kw["seed"])
    e = int(r.fields[f"{old}.embedding_length"].contents())

    def rand(*shape):  # numpy order: [.., m, k], N(0, 1/k)
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    for t in r.tensors:
        name = t.name
        if name.endswith((".ffn_gate.weight", ".ffn_up.weight")):
            continue
        if name.endswith(".ffn_down.weight"):
            p = name[: -len("ffn_down.weight")]
            w.add_tensor(p + "ffn_gate_inp.weight", rand(n, e))
            w.add_tensor(p + "ffn_gate_exps.weight", rand(n, ff, e))
            w.add_tensor(p + "ffn_up_exps.weight", rand(n, ff, e))
            w.add_tensor(p + "ffn_down_exps.weight", 3 * rand(n, e, ff))
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", rand(e))
            w.add_tensor(p + "ffn_gate_shexp.weight", rand(fs, e))
            w.add_tensor(p + "ffn_up_shexp.weight", rand(fs, e))
            w.add_tensor(p + "ffn_down_shexp.weight", 3 * rand(e, fs))
            continue
        w.add_tensor(name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def model_file(name: str) -> Path:
    """Model `name` written once into the temp directory (keyed by its arguments), for the tests."""
    import hashlib
    import os
    import tempfile

    key = hashlib.sha256(repr(sorted((MODELS.get(name) or CHAT_MODELS[name]).items())).encode()).hexdigest()[:12]
    d = Path(tempfile.gettempdir()) / f"kvchat-moe-models-{os.getuid()}"
    d.mkdir(exist_ok=True)
    path = d / f"{name}-{key}.gguf"
    if not path.exists():
        tmp = d / f".{name}-{key}.{os.getpid()}.tmp"
        write_model(name, tmp)
        os.replace(tmp, path)
    return path


def load_refs(name: str) -> dict:
    return json.loads((REFS / f"refs_{name}.json").read_text())


def make_refs(moeref: str, names, tmp: Path) -> None:
    """Run moeref on each model and write tests/moe_refs/refs_<name>.json (for a model with quantized
    experts also llama.cpp's log-probs of each prompt decoded in ubatches of one token, positions_ubatch1)."""
    import os
    import subprocess

    tmp.mkdir(parents=True, exist_ok=True)
    files = []
    for pname, text in PROMPTS.items():
        f = tmp / f"{pname}.txt"
        f.write_text(text, encoding="utf-8")
        files.append(f"{pname}={f}")
    for name in names:
        model = write_model(name, tmp / f"{name}.gguf")
        env = dict(os.environ, MOEREF_UBATCH1="1") if MODELS[name].get("experts") else None  # quantized experts
        out = subprocess.run([moeref, str(model), *files], check=True, capture_output=True, text=True, env=env).stdout
        ref = json.loads(out)
        ref.update(model=name, factory=MODELS[name])
        (REFS / f"refs_{name}.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        print(name, "ok", len(out))


if __name__ == "__main__":
    args = sys.argv[1:]
    moeref = args[args.index("--moeref") + 1]
    only = [a for a in args if a in MODELS] or list(MODELS)
    make_refs(moeref, only, Path("/tmp/moe_refs_models"))
