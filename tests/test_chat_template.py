"""Chat template tests: the real SmolLM2 template, the ChatML fallback, the sandbox and its budget,
and the `kvchat tokenize` command."""

import json
import time

import pytest
from typer.testing import CliRunner

from kvchat.runtime.errors import ChatTemplateError
from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from kvchat.runtime.text.vocab import Vocab

USER = [{"role": "user", "content": "What is a KV cache in a transformer?"}]


@pytest.mark.real_model
def test_smollm2_template_gives_reference_prompt(smollm2_path, reference_dir):
    greedy = json.loads((reference_dir / "greedy.json").read_text(encoding="utf-8"))
    expected = next(r["prompt"] for r in greedy if r["prompt"].startswith("<|im_start|>system"))
    with GGUFFile(smollm2_path) as gf:
        tpl = ChatTemplate.from_gguf(gf, Vocab.from_gguf(gf))
    assert not tpl.is_fallback
    assert tpl.render(USER, add_generation_prompt=True) == expected
    # without the generation prompt the assistant header is not there
    assert tpl.render(USER, add_generation_prompt=False) == expected[: -len("<|im_start|>assistant\n")]


@pytest.mark.real_model
def test_gemma_base_model_falls_back_to_chatml(gemma3_path):
    with GGUFFile(gemma3_path) as gf:
        assert "tokenizer.chat_template" not in gf.metadata
        tpl = ChatTemplate.from_gguf(gf, Vocab.from_gguf(gf))
    assert tpl.is_fallback and tpl.bos_token == "<bos>" and tpl.eos_token == "<eos>"
    assert tpl.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_variables_filters_and_globals(tmp_path):
    src = (
        "{{ bos_token }}|{{ messages|tojson }}|{{ {'k': 'é<&>'}|tojson(indent=1) }}|"
        "{{ strftime_now('%Y') }}|{{ tools is none }}|{% for m in messages %}{% if loop.first %}"
        "{% continue %}{% endif %}{{ m.content }}{% endfor %}"
    )
    path = tmp_path / "t.jinja"
    path.write_text(src, encoding="utf-8")
    tpl = ChatTemplate.from_file(path)
    tpl.bos_token = "<s>"
    out = tpl.render([{"role": "user", "content": "<b>ü"}, {"role": "assistant", "content": "two"}])
    year = time.strftime("%Y")
    assert out == (
        '<s>|[{"role": "user", "content": "<b>ü"}, {"role": "assistant", "content": "two"}]|'
        '{\n "k": "é<&>"\n}|' + year + "|True|two"
    )
    # trim_blocks / lstrip_blocks: block tags leave no newline or indentation behind
    assert ChatTemplate("  {% if true %}\nx\n  {% endif %}\ny").render([]) == "x\ny"


def test_raise_exception_message_surfaces():
    tpl = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start "
        "with a user message') }}{% endif %}ok"
    )
    assert tpl.render(USER) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with a user message"):
        tpl.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% set _ = messages.pop() %}",
        "{{ (messages|first).update({'a': 1}) }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
    ],
)
def test_sandbox_escapes_are_refused(source):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="sandbox") as e:
        ChatTemplate(source).render(messages)
    assert "\n" not in str(e.value)
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "source,reason",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}", "steps|exceeds"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
        ("{{ 'x' * 10**9 }}", "limit"),
        ("{{ 2 ** 100000000 }}", "limit"),
        ("{{ 'x'|center(10**9) }}", "limit"),
        ("{{ 'x'.ljust(10**9) }}", "limit"),
        ("{{ '{:>1000000000}'.format(1) }}", "limit"),
        ("{{ '%1000000000d' % 1 }}", "limit"),
        ("{{ ('x' * 999999)|replace('x', 'xx') }}", "limit"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "limit"),
        ("{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}", "exceeds"),
    ],
)
def test_runaway_templates_are_stopped_quickly(source, reason):
    """Each runaway is stopped by its guard; a step-budget case may meet the 2 s deadline first on a
    loaded machine (a million steps then take longer), which stops it as well."""
    if "steps" in reason:
        reason += "|ran longer than"
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=reason):
        ChatTemplate(source).render(USER)
    assert time.perf_counter() - t0 < 3.0


def test_time_limit_stops_a_slow_template():
    tpl = ChatTemplate(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        max_steps=10**12,
        time_limit=0.3,
    )
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="longer than 0.3 s"):
        tpl.render(USER)
    assert time.perf_counter() - t0 < 1.5


def test_syntax_and_render_errors_are_one_line(tmp_path):
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for x in %}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(USER)
    with pytest.raises(ChatTemplateError, match="cannot read"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")


def test_chatml_fallback_text():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert (
        ChatTemplate(CHATML_TEMPLATE).render(msgs, add_generation_prompt=False)
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )


@pytest.mark.real_model
def test_cli_tokenize(smollm2_path, gemma3_path, reference_dir):
    from kvchat.cli.app import app

    runner = CliRunner()
    res = runner.invoke(app, ["tokenize", "-m", str(smollm2_path), "--parse-special", "<|im_start|>user\nhi<|im_end|>"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == [1, 4093, 198, 6004, 2]
    res = runner.invoke(app, ["tokenize", "-m", str(gemma3_path), "Hello world"])
    assert json.loads(res.output) == [2, 9259, 1902]
    res = runner.invoke(app, ["tokenize", "-m", str(gemma3_path), "--no-bos", "-"], input="Hello world")
    assert json.loads(res.output) == [9259, 1902]
