"""`--exact`: the kernels in llama.cpp's float order, as KVCHAT_GGML_ORDER=1 selects them."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.cli_inproc import kvchat


def _logprobs(model, text_file, env_extra, *flags):
    env = {k: v for k, v in os.environ.items() if k != "KVCHAT_GGML_ORDER"}
    env.update(env_extra)
    r = subprocess.run(
        [sys.executable, "-c", "from kvchat.cli.app import main; main()", "logprobs", "-m", str(model)]
        + ["-f", str(text_file), "--top", "3", "-t", "2", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_exact_gives_the_log_probs_of_the_ggml_order_environment(reference_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The harbour town woke slowly, and the boats came back before dawn.")
    model = reference_dir / "tiny" / "llama3rope_s1.gguf"
    by_flag = _logprobs(model, text, {}, "--exact")
    by_env = _logprobs(model, text, {"KVCHAT_GGML_ORDER": "1"})
    assert by_flag == by_env and len(json.dumps(by_flag)) > 100
    assert by_flag != _logprobs(model, text, {})  # the default flash kernel's last bits differ


def test_exact_in_a_process_whose_kernels_are_loaded_says_so_in_one_line(reference_dir):
    import kvchat.kernels.qlayout as qlayout

    if qlayout.GGML_ORDER_PARTS == qlayout.GGML_ORDER_ALL:
        pytest.skip("this test process runs the exact kernels already")
    model = reference_dir / "tiny" / "llama3rope_s1.gguf"
    r = kvchat("run", "-m", model, "-p", "hi", "-n", "2", "--exact")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "KVCHAT_GGML_ORDER=1" in lines[0], r.stderr
