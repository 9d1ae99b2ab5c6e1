"""A first run answers on the serial twins while the parallel ones compile (kernels.parallel.hold_serial):
held, a forward launches no parallel kernel and its logits are the same bits."""

import importlib
import pkgutil

import numpy as np
import pytest
from numba.core.registry import CPUDispatcher

import kvchat.kernels
from kvchat.kernels import parallel


def parallel_kernels():
    """(module, name) of every parallel numba kernel in kvchat.kernels."""
    found = []
    for info in pkgutil.iter_modules(kvchat.kernels.__path__):
        module = importlib.import_module(f"kvchat.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher) and obj.targetoptions.get("parallel"):
                found.append((module, name))
    return found


class Spy:
    """A kernel as its callers see it (called, or its overloads looked up for their entry point
    as kernels/matmul.QMatrix does), noting its name on either."""

    def __init__(self, kernel, name, calls):
        self._kernel, self._name, self._calls = kernel, name, calls

    def __call__(self, *args):
        self._calls.append(self._name)
        return self._kernel(*args)

    @property
    def overloads(self):
        self._calls.append(self._name)
        return self._kernel.overloads

    def __getattr__(self, attr):
        return getattr(self._kernel, attr)


@pytest.fixture
def launched(monkeypatch):
    """The names of the parallel kernels used while the test runs (spied where they are looked up)."""
    calls = []
    kernels = {id(getattr(m, n)): getattr(m, n) for m, n in parallel_kernels()}
    for info in pkgutil.iter_modules(kvchat.kernels.__path__):
        module = importlib.import_module(f"kvchat.kernels.{info.name}")
        for name, obj in list(vars(module).items()):
            if id(obj) in kernels:
                monkeypatch.setattr(module, name, Spy(obj, name, calls))
    return calls


ARCHS = ["llama", "gemma3", "llama-q8_0", "olmoe", "olmoe-q8_0"]  # F32 and quantized, dense and MoE


def decode_logits(path, prompt):
    from kvchat.runtime.context import Context
    from kvchat.runtime.cparams import ContextParams
    from kvchat.runtime.generate import decode_one, decode_tokens
    from kvchat.runtime.model import Model

    ctx = Context(Model.load(path), ContextParams(n_ctx=256, n_batch=64, n_ubatch=64))
    first = np.array(decode_tokens(ctx, prompt, 0), copy=True)
    step = np.array(decode_one(ctx, prompt[0], len(prompt)), copy=True)
    return first, step


def model_of(arch, tiny_model, tmp_path):
    from kvchat.kernels.ggml_types import GGMLType
    from tests.helpers.arch_refs import model_path
    from tests.helpers.gguf_factory import quantized_copy

    if arch == "llama-q8_0":
        return tiny_model("llama", weight_type=GGMLType.Q8_0)
    if arch == "olmoe":
        return model_path("olmoe_s1")
    if arch == "olmoe-q8_0":
        return quantized_copy(model_path("olmoe_s1"), tmp_path / "olmoe_s1-q8_0.gguf")
    return tiny_model(arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_held_forward_runs_only_serial_kernels_and_gives_the_same_logits(tiny_model, tmp_path, launched, arch):
    path = model_of(arch, tiny_model, tmp_path)
    prompt = [(7 * i + 3) % 200 + 1 for i in range(64)]  # past every parallel threshold
    free = decode_logits(path, prompt)
    assert launched, "the free run launches parallel kernels"
    launched.clear()
    parallel.hold_serial()
    try:
        held = decode_logits(path, prompt)
    finally:
        parallel.release()
    assert launched == [], launched  # every kernel has its serial twin (float matmuls and MoE routing too)
    for a, b in zip(free, held):
        np.testing.assert_array_equal(a, b)


def test_release_gives_every_threshold_back_and_both_are_idempotent():
    before = {n: getattr(parallel, n) for n in parallel._HELD}
    parallel.hold_serial()
    parallel.hold_serial()
    assert parallel.serial_held() and all(getattr(parallel, n) > 1 << 40 for n in parallel._HELD)
    parallel.release()
    parallel.release()
    assert not parallel.serial_held() and {n: getattr(parallel, n) for n in parallel._HELD} == before
