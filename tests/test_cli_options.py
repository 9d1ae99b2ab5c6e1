"""cli/options.py is the one table of flags: the same range checks refuse a bad value given as a
flag (a usage error before any model is loaded) and through /set in the chat (an error line, the
chat goes on); /set and /help list exactly the table's live options."""

import math

import pytest
from typer.testing import CliRunner

from kvchat.cli.app import app
from kvchat.cli.chat.render import Renderer
from kvchat.cli.chat.repl import COMMANDS, Repl
from kvchat.cli.options import BY_NAME, LIVE, LIVE_BY_KEY, OPTIONS, ChatSettings, parse_value
from kvchat.runtime.chat.conversation import ConversationConfig
from kvchat.runtime.errors import KvchatError
from kvchat.runtime.sampling import SamplingParams
from tests.test_conversation import make

# issue 10's list, and a few neighbours
REFUSED = [
    ("top-k", "-5"),
    ("n-predict", "-7"),
    ("temp", "-1"),
    ("temp", "nan"),
    ("temp", "inf"),
    ("top-p", "nan"),
    ("top-p", "5"),
    ("keep", "-9"),
    ("min-p", "1.5"),
    ("seed", "-2"),
    ("repeat-penalty", "0"),
    ("repeat-last-n", "-2"),
    ("temp", "warm"),
    ("context-shift", "maybe"),
]
ACCEPTED = [
    ("seed", "-1", None),
    ("seed", "7", 7),
    ("temp", "0", 0.0),
    ("top-k", "0", 0),
    ("n-predict", "-1", -1),
    ("keep", "-1", -1),
    ("top-p", "1", 1.0),
    ("context-shift", "off", False),
    ("ignore-eos", "on", True),
]


def flag_of(key):
    return next(f for f in LIVE_BY_KEY[key].flags if f.startswith("--")).split("/")[0]


@pytest.mark.parametrize("key, value", [r for r in REFUSED if r[0] != "context-shift"])
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(key, value, tmp_path):
    r = CliRunner().invoke(app, ["run", "-m", str(tmp_path / "none.gguf"), "-p", "hi", flag_of(key), value])
    assert r.exit_code == 2, r.output
    assert f"'{flag_of(key)}'" in r.output


@pytest.mark.parametrize("cmd", [["bench"], ["perplexity", "-f", "x.txt"]])
def test_commands_with_cache_flags_check_them_with_the_same_table(cmd, tmp_path):
    for bad in (["-ub", "0"], ["-b", "-3"], ["-t", "0"], ["-fa", "sometimes"]):
        r = CliRunner().invoke(app, [*cmd, "-m", str(tmp_path / "none.gguf"), *bad])
        assert r.exit_code == 2, (cmd, bad, r.output)


def repl():
    conv, _, _ = make()
    conv.config = ConversationConfig(system_prompt="SYS")
    return Repl(engine=None, conv=conv, settings=ChatSettings(), renderer=Renderer())


@pytest.mark.parametrize("key, value", REFUSED)
def test_set_refuses_what_the_flag_refuses_and_changes_nothing(key, value):
    r = repl()
    before = (r.conv.sampler.params.to_dict(), dict(vars(r.conv.config)), r.conv.sampler.seed)
    with pytest.raises(KvchatError) as e:
        r.cmd_set(f"{key} {value}")
    assert str(e.value).startswith(f"/set {key}: ")
    assert (r.conv.sampler.params.to_dict(), dict(vars(r.conv.config)), r.conv.sampler.seed) == before


@pytest.mark.parametrize("key, value, expected", ACCEPTED)
def test_set_applies_a_good_value_where_it_belongs(key, value, expected):
    r = repl()
    old_seed = r.conv.sampler.seed
    r.cmd_set(f"{key} {value}")
    option = LIVE_BY_KEY[key]
    if option.live == "sampling":
        assert getattr(r.conv.sampler.params, option.name) == expected
        if key == "seed" and expected is not None:
            assert r.conv.sampler.seed == expected
        elif key == "seed":  # -1: a fresh random seed, as at startup
            assert isinstance(r.conv.sampler.seed, int)
        else:
            assert r.conv.sampler.seed == old_seed  # the random stream goes on
    else:
        assert getattr(r.conv.config, option.name) == expected


def test_set_output_options_reach_the_renderer_and_settings():
    r = repl()
    r.cmd_set("markdown on")
    r.cmd_set("show-timings yes")
    assert r.r.markdown is True and r.settings.markdown is True and r.settings.show_timings is True


def test_unknown_set_parameter_suggests_the_closest():
    with pytest.raises(KvchatError, match="did you mean top-k"):
        repl().cmd_set("top-kk 3")


def test_help_and_set_list_the_live_options_of_the_table():
    keys = [o.key for o in LIVE]
    assert keys == [
        "cache-type-k",
        "cache-type-v",
        "keep",
        "context-shift",
        "n-predict",
        "temp",
        "top-k",
        "top-p",
        "min-p",
        "repeat-penalty",
        "repeat-last-n",
        "seed",
        "ignore-eos",
        "show-timings",
        "markdown",
        "reasoning",
        "reasoning-budget",
        "reasoning-effort",
    ]
    assert COMMANDS["/set"] == (
        f"/set PARAM VALUE ({', '.join(keys)}); /set format json|schema FILE|grammar FILE|off; /set alone lists"
    )
    sampling = set(SamplingParams().to_dict())
    for o in LIVE:
        where = {
            "sampling": sampling,
            "conversation": set(vars(ConversationConfig())),
            "output": set(vars(ChatSettings())),
            "cache": {"cache_type_k", "cache_type_v"},
        }[o.live]
        assert o.name in where, o.name


def test_every_default_passes_its_own_check():
    for o in OPTIONS:
        if o.check is not None:
            assert o.check(o.default) == o.default, o.name


def test_parse_value_uses_the_flag_type():
    assert parse_value(BY_NAME["temp"], "0.5") == 0.5
    assert parse_value(BY_NAME["top_k"], "3") == 3
    with pytest.raises(ValueError, match="whole number"):
        parse_value(BY_NAME["top_k"], "3.5")
    assert math.isclose(parse_value(BY_NAME["min_p"], "0.1"), 0.1)


def test_seed_minus_one_is_accepted_as_random(tmp_path):
    """Parsing succeeds; the run then fails on the missing model (exit 1, not a usage error)."""
    r = CliRunner().invoke(app, ["run", "-m", str(tmp_path / "none.gguf"), "-p", "hi", "--seed", "-1"])
    assert r.exit_code == 1 and "none.gguf" in str(r.exception) + r.output
