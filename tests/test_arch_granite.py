"""granite (embedding / residual / attention multipliers, logit scale) against llama.cpp on the
tiny reference model granite_s1, and on factory variants."""

import numpy as np
import pytest

from tests.helpers import arch_refs

NAME = "granite_s1"


class TestAgainstLlamaCpp(arch_refs.ReferenceChecks):
    name = NAME


def _granite(tmp_path, name, **meta):
    from kvchat.runtime.model import Model
    from tests.helpers.gguf_factory import write_tiny_model

    keys = {"granite.logit_scale": 1.0}
    keys.update({f"granite.{k}": v for k, v in meta.items()})
    return Model.load(write_tiny_model(tmp_path / name, arch="granite", n_layer=2, metadata=keys))


def test_the_multipliers_are_read_and_applied(tmp_path):
    tokens = list(range(5, 30))
    base = _granite(tmp_path, "a.gguf")
    hp = base.hparams
    assert (hp.embed_scale, hp.residual_scale, hp.logit_scale) == (1.0, 1.0, 1.0)
    assert hp.kq_scale == pytest.approx(16**-0.5)
    plain = arch_refs.all_logits(base, tokens)
    # logits divided by logit_scale, exactly (x * f32(1/4))
    np.testing.assert_array_equal(
        arch_refs.all_logits(_granite(tmp_path, "b.gguf", logit_scale=4.0), tokens), plain * np.float32(0.25)
    )
    m = _granite(tmp_path, "c.gguf", embedding_scale=12.0, residual_scale=0.22, **{"attention.scale": 0.0625})
    assert (m.hparams.embed_scale, m.hparams.residual_scale, m.hparams.kq_scale) == (12.0, pytest.approx(0.22), 0.0625)
    assert np.abs(arch_refs.all_logits(m, tokens) - plain).max() > 1e-2


def test_logit_scale_is_required(tmp_path):
    from kvchat.runtime.errors import ModelFileError
    from kvchat.runtime.model import Model
    from tests.helpers.gguf_factory import write_tiny_model

    with pytest.raises(ModelFileError, match=r"granite.logit_scale.*missing"):
        Model.load(write_tiny_model(tmp_path / "x.gguf", arch="granite", n_layer=2))
