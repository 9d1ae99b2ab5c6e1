"""kvchat bench of ggml's orders (KVCHAT_GGML_ORDER) against the defaults, alternated, as ratios.

    python benchmarks/fidelity/orders_ab.py ROUNDS on|off LABEL:VENV_DIR:ORDER ...

Each configuration is a kvchat (the `kvchat` of VENV_DIR/bin, so two trees can be compared) and a
KVCHAT_GGML_ORDER value ("" for the defaults, "1", or parts: q4_1, flash, softmax). Every
configuration runs once untimed (numba compiles), then each round runs each configuration's
`kvchat bench -m $AB_MODEL (smollm2) -t 2 -fa on|off --json $AB_ARGS (-p 512 -n 128 -r 3)` under
the shared bench lock (flock /tmp/kvchat-bench.lock); the summary is the median and best t/s
over all samples of a configuration (docs/performance.md, "Accuracy", issue 24 fid9).
"""

import json
import os
import statistics
import subprocess
import sys
import time


def main():
    rounds, fa = int(sys.argv[1]), sys.argv[2]
    cfgs = [c.split(":") for c in sys.argv[3:]]
    extra = os.environ.get("AB_ARGS", "-p 512 -n 128 -r 3").split()
    model = os.environ.get("AB_MODEL", "smollm2")
    res = {}

    def run(venv, order, timed):
        env = dict(os.environ, KVCHAT_GGML_ORDER=order)
        cmd = ["nice", "-n", "19", f"{venv}/bin/kvchat", "bench", "-m", model, "-t", "2", "-fa", fa, "--json"]
        cmd += extra if timed else ["-p", "64", "-n", "4", "-r", "1"]
        if timed:
            cmd = ["flock", "/tmp/kvchat-bench.lock"] + cmd
        return json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp").stdout)

    for _, venv, order in cfgs:
        run(venv, order, False)
    for r in range(rounds):
        for lab, venv, order in cfgs:
            load = open("/proc/loadavg").read().split()[0]
            for t in run(venv, order, True):
                res.setdefault((lab, t["test"]), []).extend(t["samples_ts"])
                xs = " ".join(f"{x:.1f}" for x in t["samples_ts"])
                print(f"r{r} {time.strftime('%H:%M:%S')} load {load} {lab:12s} {t['test']:6s} {xs}", flush=True)
    print("summary fa=" + fa)
    for (lab, test), xs in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{test:6s} {lab:12s} median {statistics.median(xs):8.1f} best {max(xs):8.1f} n={len(xs)}")


if __name__ == "__main__":
    main()
