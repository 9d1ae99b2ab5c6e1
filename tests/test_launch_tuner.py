"""kernels/launch_tuner.py: which arm each one-token step runs on (fake clock), and that the arm
never changes a token or a logit (tiny quantized models, both arms' kernels really run)."""

import numpy as np
import pytest

import kvchat.kernels.attention as ka
import kvchat.kernels.matmul as km
from kvchat.kernels import parallel
from kvchat.kernels.ggml_types import GGMLType
from kvchat.kernels.launch_tuner import PARALLEL, SERIAL, LaunchTuner
from kvchat.runtime.context import Context
from kvchat.runtime.cparams import ContextParams
from kvchat.runtime.generate import decode_tokens, generate
from kvchat.runtime.model import Model

S, P = SERIAL, PARALLEL


class FakeStep:
    """A model whose forward takes `cost[arm]` seconds on a fake clock; the arm is read from the
    matmul threshold the tuner gives the forward, as the real matmuls take it."""

    def __init__(self):
        self.now = 0.0
        self.cost = {S: 0.012, P: 0.010}  # quiet machine: parallel faster
        self.arms = []

    def clock(self):
        return self.now

    def forward(self, ub, mctx, min_macs=None):
        arm = P if min_macs == 0 else S
        if ub.n_tokens == 1:
            self.arms.append(arm)
        self.now += self.cost[arm]
        return "logits"


class UB:
    def __init__(self, n):
        self.n_tokens = n


def run(tuner, fake, n):
    for _ in range(n):
        assert tuner.forward(fake, UB(1), None) == "logits"
    out, fake.arms = fake.arms, []
    return out


def test_the_first_probe_runs_each_arm_once_uncounted_then_three_times_and_keeps_the_faster():
    fake = FakeStep()
    tuner = LaunchTuner(fake.clock, enabled=True)
    assert run(tuner, fake, 8) == [P, S, P, S, P, S, P, S]
    assert tuner.arm == P and not tuner.probing
    assert [a for a, _ in tuner.history] == [P, S, P, S, P, S]  # the two warm-up steps not counted
    assert run(tuner, fake, 20) == [P] * 20


def test_serial_is_kept_when_parallel_is_not_faster_by_the_margin():
    fake = FakeStep()
    fake.cost = {S: 0.010, P: 0.0099}  # 1 % faster: inside the 3 % margin
    tuner = LaunchTuner(fake.clock, enabled=True)
    run(tuner, fake, 8)
    assert tuner.arm == S
    assert run(tuner, fake, 10) == [S] * 10


def test_load_appearing_moves_generation_to_one_core_within_a_few_steps():
    fake = FakeStep()
    tuner = LaunchTuner(fake.clock, enabled=True)
    run(tuner, fake, 8 + 5)
    fake.cost = {S: 0.012, P: 0.037}  # a busy loop took a core: parallel launches wait
    arms = run(tuner, fake, 8)
    # two slow steps make the median of three move past the drift bound, then a short probe
    assert arms == [P, P, S, P, S, P, S, S]
    assert tuner.arm == S and tuner.period == tuner.base_period


def test_load_going_away_is_found_by_the_periodic_probe():
    fake = FakeStep()
    fake.cost = {S: 0.013, P: 0.037}
    tuner = LaunchTuner(fake.clock, enabled=True, period=8, max_period=16)
    run(tuner, fake, 8)
    assert tuner.arm == S and tuner.period == 16  # the choice held: the period doubled
    fake.cost = {S: 0.012, P: 0.010}  # the load is gone; serial barely changes (no drift)
    arms = run(tuner, fake, 16 + 4 + 3)
    assert arms[:16] == [S] * 16 and arms[16:20] == [P, S, P, S] and arms[20:] == [P] * 3
    assert tuner.arm == P and tuner.period == 8  # the choice flipped: back to the base period


def test_a_stable_choice_is_reprobed_ever_less_often_up_to_max_period():
    fake = FakeStep()
    tuner = LaunchTuner(fake.clock, enabled=True, period=4, max_period=16)
    arms = run(tuner, fake, 8 + 4 + 4 + 8 + 4 + 16 + 4 + 16)
    probe = [S, P, S, P]  # the arm not exploited first
    assert arms[8:12] == [P] * 4 and arms[12:16] == probe  # first choice flipped S -> P: base period
    assert arms[16:24] == [P] * 8 and arms[24:28] == probe
    assert arms[28:44] == [P] * 16 and arms[44:48] == probe and arms[48:] == [P] * 16
    assert tuner.period == 16


def test_a_reprobe_stops_after_one_step_of_an_arm_that_is_clearly_worse():
    fake = FakeStep()
    fake.cost = {S: 0.012, P: 0.037}  # loaded machine
    tuner = LaunchTuner(fake.clock, enabled=True, period=8, max_period=64)
    run(tuner, fake, 8)
    assert tuner.arm == S and tuner.period == 16
    arms = run(tuner, fake, 16 + 1 + 32 + 1 + 3)
    assert arms == [S] * 16 + [P] + [S] * 32 + [P] + [S] * 3  # one parallel step per probe
    assert tuner.arm == S and tuner.period == 64 and not tuner.probing


def test_a_slower_serial_step_does_not_probe_parallel_which_load_makes_slower_still():
    fake = FakeStep()
    fake.cost = {S: 0.012, P: 0.037}
    tuner = LaunchTuner(fake.clock, enabled=True, period=64, max_period=64)
    run(tuner, fake, 8)
    assert tuner.arm == S
    fake.cost = {S: 0.020, P: 0.060}  # more load: serial 1.7x slower, past the drift bound
    assert run(tuner, fake, 40) == [S] * 40  # only the periodic probe (at 128 steps) looks again


def test_false_drift_alarms_wait_ever_longer_before_the_next_drift_probe():
    fake = FakeStep()
    fake.cost = {S: 0.012, P: 0.037}  # loaded: serial is right
    tuner = LaunchTuner(fake.clock, enabled=True, period=128, max_period=128)
    run(tuner, fake, 8)
    assert tuner.arm == S
    fake.cost = {S: 0.008, P: 0.037}  # serial steps look faster (jitter): a drift, but parallel is still worse
    arms = run(tuner, fake, 3 + 1 + 4 + 1 + 8 + 1 + 16 + 1)
    p_at = [i for i, a in enumerate(arms) if a == P]
    # each false alarm costs one parallel step, and the gap before the next one doubles: 4, 8, 16
    assert p_at == [3, 8, 17, 34] and tuner.drift_gap == 32 and tuner.arm == S


# Prompt ubatches never reach the tuner (Context.decode does not ask it): tests/test_batch_one_token.py.


def test_the_threshold_is_restored_after_a_step_that_raises():
    fake = FakeStep()
    tuner = LaunchTuner(fake.clock, enabled=True)
    before = parallel.MATMUL_PAR_MIN_MACS

    def boom(ub, mctx, min_macs=None):
        assert min_macs == 0 and parallel.MATMUL_PAR_MIN_MACS == before  # an argument, no global patched
        raise RuntimeError("x")

    fake.forward = boom
    with pytest.raises(RuntimeError):
        tuner.forward(fake, UB(1), None)
    assert parallel.MATMUL_PAR_MIN_MACS == before and not tuner.history and tuner.next_arm() == P


def test_a_user_threshold_in_the_environment_turns_the_tuner_off(monkeypatch):
    monkeypatch.setenv("KVCHAT_MATMUL_PAR_MIN_MACS", "300000")
    fake = FakeStep()
    tuner = LaunchTuner(fake.clock)
    assert not tuner.enabled
    assert run(tuner, fake, 10) == [S] * 10 and not tuner.history
    monkeypatch.delenv("KVCHAT_MATMUL_PAR_MIN_MACS")
    assert LaunchTuner(fake.clock).enabled


class Pinned(LaunchTuner):
    """A tuner that always runs one arm (what a machine's load could make the real one do)."""

    def __init__(self, arm):
        super().__init__(enabled=True)
        self.pinned = arm

    def next_arm(self):
        return self.pinned


@pytest.mark.parametrize("arch, wtype", [("llama", GGMLType.Q8_0), ("gemma3", GGMLType.Q4_0), ("qwen2", GGMLType.Q4_1)])
def test_generation_is_bit_identical_whichever_arm_each_step_runs(tiny_model, monkeypatch, arch, wtype):
    model = Model.load(tiny_model(arch, n_embd=128, n_ff=256, weight_type=wtype))
    kernels = []
    real_call = km.QMatrix._call
    monkeypatch.setattr(
        km.QMatrix, "_call", lambda self, kernel, args: (kernels.append(kernel), real_call(self, kernel, args))[1]
    )
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 250, 9)]

    def gen(tuner):
        ctx = Context(model, ContextParams(n_ctx=128, n_batch=64, n_ubatch=64, type_k="f16", type_v="f16"))
        ctx.launch = tuner
        logits = []

        def sample(row):
            logits.append(row.copy())
            return int(np.argmax(row))

        first = decode_tokens(ctx, prompt, 0)
        kernels.clear()  # the prompt's matmuls (9 tokens: serial twins) are not the tuner's
        ka._LAUNCHES.clear()  # nor its attention launches
        toks = [s.token for s in generate(ctx, sample, logits=first, pos0=len(prompt), max_tokens=24)]
        attn = {plan[0] for key, plan in ka._LAUNCHES.items() if key[1] == 1}  # one-token attention kernels
        return toks, np.stack(logits), set(kernels), attn

    ser_toks, ser_logits, ser_kernels, ser_attn = gen(Pinned(S))
    par_toks, par_logits, par_kernels, par_attn = gen(Pinned(P))
    mix_toks, mix_logits, _, _ = gen(LaunchTuner(enabled=True))  # probes: both arms, interleaved
    assert km.matmul_q in par_kernels and km.matmul_q_serial in ser_kernels
    assert km.matmul_q_serial not in par_kernels  # every one-token layer matmul went parallel
    # a tiny model's attention is below the configured threshold: serial on SERIAL, split on PARALLEL
    assert par_attn == {ka._flash_attn_par} and ser_attn == {ka.flash_attn_ser}
    assert ser_toks == par_toks == mix_toks and len(ser_toks) == 24
    assert np.array_equal(ser_logits, par_logits) and np.array_equal(ser_logits, mix_logits)
