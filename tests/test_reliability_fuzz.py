"""Random bytes (valid and invalid UTF-8, control characters) through the tokenizers, `kvchat run`,
`kvchat tokenize` and the session reader: a result or one error line, never a traceback."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchat.runtime.errors import SessionError
from tests.conftest import ROOT
from tests.helpers.gguf_factory import write_tiny_model

TEXT_BYTES = st.one_of(
    st.binary(min_size=0, max_size=64),
    st.text(max_size=32).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.lists(
        st.sampled_from(
            [
                b"\x00",
                b"\x1b[0m",
                b"\xff",
                b"\xc3",
                b"\xe2\x82",
                b"\r",
                b"\n",
                b"\t",
                b"<|im_start|>",
                b"\xf0\x9f\xa6\x99",
                "é".encode(),
                b" ",
            ]
        ),
        max_size=12,
    ).map(b"".join),
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    return {arch: write_tiny_model(d / f"{arch}.gguf", arch=arch) for arch in ("llama", "gemma3")}


@pytest.fixture(scope="module")
def vocabs(models):
    from kvchat.runtime.gguf.file import GGUFFile
    from kvchat.runtime.text.vocab import Vocab

    out = {}
    for arch, path in models.items():
        with GGUFFile(path) as gf:
            out[arch] = Vocab.from_gguf(gf)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=TEXT_BYTES, parse_special=st.booleans())
def test_any_bytes_tokenize_like_their_replaced_text(vocabs, data, parse_special):
    as_python_sees_it = data.decode("utf-8", "surrogateescape")  # argv / stdin / terminal input
    replaced = data.decode("utf-8", "kvchat-per-byte")
    for vocab in vocabs.values():
        ids = vocab.tokenize(as_python_sees_it, parse_special=parse_special)
        assert ids == vocab.tokenize(replaced, parse_special=parse_special)
        assert all(0 <= t < vocab.n_vocab for t in ids)
        vocab.detokenize(ids)


def kvchat(args, input=None):
    cmd = [sys.executable, "-c", "from kvchat.cli.app import main; main()", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KVCHAT_DEBUG", None)
    return subprocess.run(cmd, input=input, capture_output=True, timeout=600, cwd=ROOT, env=env)


def assert_clean(r):
    err = r.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    assert r.returncode in (0, 1), err
    if r.returncode == 1:
        assert len([x for x in err.splitlines() if x.strip()]) == 1 and err.startswith("error: "), err


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=TEXT_BYTES.filter(lambda b: b"\x00" not in b), via=st.sampled_from(["argv", "stdin"]))
def test_run_answers_or_refuses_any_bytes_in_one_line(models, data, via):
    base = [b"run", b"-m", os.fsencode(models["llama"]), b"-c", b"256", b"-n", b"3", b"--temp", b"0"]
    r = kvchat(base + [b"-p", data]) if via == "argv" else kvchat(base, input=data)
    assert_clean(r)
    if not data.strip():
        return
    assert r.returncode == 0, r.stderr


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=TEXT_BYTES.filter(lambda b: b"\x00" not in b and not b.startswith(b"-")))
def test_tokenize_command_prints_ids_for_any_bytes(models, vocabs, data):
    r = kvchat([b"tokenize", b"-m", os.fsencode(models["gemma3"]), b"--", data])
    assert_clean(r)
    assert r.returncode == 0
    assert json.loads(r.stdout) == vocabs["gemma3"].tokenize(data.decode("utf-8", "kvchat-per-byte"))


@settings(max_examples=300, deadline=None)
@given(
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 10_000) | st.none(),
)
def test_damaged_session_files_are_refused_with_session_error_only(flips, cut):
    from kvchat.cli.session.session import SessionData, decode_session, encode_session

    data = SessionData(
        model={"file": "m", "size": 1, "header_sha256": "0" * 64},
        cache={"n_ctx": 256, "type_k": "f16", "type_v": "f16", "flash_attn": True, "swa_full": False},
        messages=[{"role": "user", "content": "hé"}],
        sampling={"temp": 0.1},
        tokens=[1, 2],
        state=bytes(range(200)),
    )
    blob = bytearray(encode_session(data))
    for where, x in flips:
        blob[where % len(blob)] ^= x
    if cut is not None:
        blob = blob[: cut % (len(blob) + 1)]
    try:
        decode_session(bytes(blob))
    except SessionError as e:
        assert "\n" not in str(e)
