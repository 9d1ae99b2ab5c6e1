"""Speculative decoding (llama.cpp's common/speculative.cpp and examples/speculative-simple):
draft sources (ngram.py, draft_model.py, self_quant.py + self_draft.py), the draft length and counts
(speculator.py), and the generation loop that verifies drafts in one batch (generate.py).
`make_speculator` builds one from what the user asked for."""

from __future__ import annotations

from kvchat.runtime.speculative.speculator import DRAFT_MAX, DRAFT_P_MIN, Speculator

SPEC_TYPES = ("draft", "ngram", "self:TYPE")


def make_speculator(
    target_ctx,
    kind: str,
    *,
    draft_path=None,
    draft_max: int = DRAFT_MAX,
    draft_min: int = 0,
    draft_p_min: float = DRAFT_P_MIN,
    abort_callback=None,
) -> Speculator:
    """A Speculator for `target_ctx` (a Context): kind "ngram", "draft" (draft_path: a GGUF of the
    same vocabulary) or "self:TYPE" (a TYPE copy of the target's weights). The draft model's
    Context takes the target's context parameters; a self-draft's — or a draft model's of the
    target's exact shape — shares the target's memory (self_draft.py), any other has its own
    (ModelDraft). A model draft stops
    at a token it gives less than draft_p_min probability. KvchatError (one line) for what cannot work."""
    from kvchat.runtime.errors import KvchatError

    if kind == "ngram":
        from kvchat.runtime.speculative.ngram import NgramDraft

        source = NgramDraft()
    elif kind == "draft" or kind.startswith("self:"):
        from kvchat.runtime.context import Context
        from kvchat.runtime.speculative.draft_model import ModelDraft, check_same_vocab

        target = target_ctx.model
        if kind == "draft":
            if draft_path is None:
                raise KvchatError("--spec-type draft needs a draft model: give -md FILE")
            from kvchat.runtime.model import Model

            draft = Model.load(draft_path)
            check_same_vocab(target.vocab, draft.vocab, str(draft_path))
            name = f"draft {draft.path.name}"
        else:
            from kvchat.runtime.speculative.self_quant import quantized_copy

            draft = quantized_copy(target, kind[5:])
            name = kind
        params = target_ctx.params
        n_vocab = int(target.hparams.n_vocab)
        from kvchat.runtime.speculative.self_draft import SelfDraft, same_shape

        if same_shape(draft, target):  # the copy (or a -md file of the target's shape) drafts in its memory
            ctx = Context(draft, params, abort_callback=abort_callback, memory=target_ctx.memory)
            source = SelfDraft(ctx, name=name, n_vocab_target=n_vocab, p_min=draft_p_min)
        else:
            from dataclasses import replace

            one = replace(params, n_ctx=int(target_ctx.n_ctx_seq), n_seq_max=1, kv_unified=True)
            ctx = Context(draft, one, abort_callback=abort_callback)
            source = ModelDraft(ctx, name=name, n_vocab_target=n_vocab, p_min=draft_p_min)
    else:
        raise KvchatError(f"--spec-type {kind}: unknown; use one of {', '.join(SPEC_TYPES)}")
    try:
        return Speculator(source, draft_max=draft_max, draft_min=draft_min)
    except ValueError as e:
        raise KvchatError(str(e)) from None
