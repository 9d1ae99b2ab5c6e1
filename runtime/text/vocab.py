"""The vocabulary of a GGUF model: tokenize, detokenize, special tokens, end-of-generation set.

Mirrors llama.cpp's llama_vocab so that ids match it exactly:
- `tokenizer.ggml.model` "llama" → SPM (runtime/text/tokenizer_spm.py), "gpt2" → byte-level BPE
  (runtime/text/tokenizer_bpe.py, pre-tokenizer chosen by `tokenizer.ggml.pre`);
- before either runs, the text is cut at the texts of special tokens (control, user-defined and
  unknown tokens, longest first); with parse_special=False only user-defined tokens are cut out,
  so "<|im_start|>" typed by a user stays plain text;
- BOS/EOS are added per tokenizer.ggml.add_bos_token / add_eos_token, with llama.cpp's defaults
  when the file is silent (SPM adds BOS, BPE does not unless its pre-tokenizer says so);
- the EOG set is eos, eot, eom plus every token whose text llama.cpp treats as an end of turn.

Lookup tables are built once per file; per-token pieces are computed lazily and cached, so a
262144-token vocabulary loads in a fraction of a second.
"""

from __future__ import annotations

from array import array

import numpy as np

from kvchat.runtime.errors import ModelFileError
from kvchat.runtime.gguf.string_array import StringArray, StringIndex
from kvchat.runtime.text.detokenize import clean_spaces
from kvchat.runtime.text.tokenizer_bpe import BPETokenizer, byte_decode, pre_tokenizer, supported_pre_names
from kvchat.runtime.text.tokenizer_spm import spm_tokenize
from kvchat.runtime.text.utf8 import clean_text

# llama_token_attr bit flags (llama.h)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
# GGUF tokenizer.ggml.token_type values 0..6 → attributes
_TYPE_TO_ATTR = np.array(
    [ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_UNUSED, ATTR_BYTE], dtype=np.int32
)

# Texts llama.cpp recognises as special tokens when the metadata does not name them.
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)

_SPACE_ESCAPE = "\u2581"  # '▁', SentencePiece's visible space
_KEY = "tokenizer.ggml."


class Vocab:
    """Tokens, their attributes and the tokenizer of one model (see module docstring)."""

    def __init__(
        self,
        *,
        kind: str,
        tokens: list[str],
        token_types,
        scores=None,
        merges=None,
        pre: str | None = None,
        bos=None,
        eos=None,
        eot=None,
        eom=None,
        unk=None,
        pad=None,
        add_bos=None,
        add_eos=None,
        add_space_prefix=None,
        source: str = "<vocab>",
    ):
        if not tokens:
            raise ModelFileError(f"{source}: {_KEY}tokens: empty vocabulary")
        self.source = source
        self.kind = kind
        self.n_vocab = len(tokens)
        # llama.cpp gives empty token texts a placeholder so that every text maps to one id.
        # Texts live in one blob with a hash index (runtime/gguf/string_array.py), not as Python objects.
        if not isinstance(tokens, StringArray) or tokens.has_empty():
            tokens = StringArray.from_strings(t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens))
        self.tokens: StringArray = tokens
        self.token_to_id = StringIndex(tokens)  # text -> id (the last id of a repeated text)
        types = np.zeros(self.n_vocab, dtype=np.int64) if token_types is None else np.asarray(token_types)
        if types.shape[0] < self.n_vocab:
            raise ModelFileError(f"{source}: {_KEY}token_type: {types.shape[0]} entries for {self.n_vocab} tokens")
        types = types[: self.n_vocab].astype(np.int64)
        self.attrs = np.where(
            (types >= 0) & (types < len(_TYPE_TO_ATTR)),
            _TYPE_TO_ATTR[np.clip(types, 0, len(_TYPE_TO_ATTR) - 1)],
            ATTR_UNDEFINED,
        )
        if scores is None:  # array('f'): indexing gives the float32 value as a Python float
            self.scores = array("f", bytes(4 * self.n_vocab))
        else:
            scores = np.asarray(scores, dtype=np.float32)
            if scores.shape[0] < self.n_vocab:
                raise ModelFileError(f"{source}: {_KEY}scores: {scores.shape[0]} entries for {self.n_vocab} tokens")
            self.scores = array("f", scores[: self.n_vocab].tobytes())

        if kind == "spm":
            default_bos, default_eos, default_unk = 1, 2, 0
            self.add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
            self.add_bos = True if add_bos is None else bool(add_bos)
            self.add_eos = False if add_eos is None else bool(add_eos)
            self.clean_spaces = False
            self._bpe = None
        elif kind == "bpe":
            default_bos, default_eos, default_unk = 11, 11, None
            pre_tok = pre_tokenizer(pre)
            if pre_tok is None:
                raise ModelFileError(
                    f"{source}: {_KEY}pre: unsupported pre-tokenizer '{pre}' "
                    f"(supported: {', '.join(supported_pre_names())})"
                )
            if merges is None:
                raise ModelFileError(f"{source}: {_KEY}merges: missing (a BPE vocabulary needs its merges)")
            self.add_space_prefix = False  # llama.cpp ignores the key for BPE
            self.add_bos = pre_tok.add_bos if add_bos is None else bool(add_bos)
            self.add_eos = False if add_eos is None else bool(add_eos)
            self.clean_spaces = pre_tok.clean_spaces
            self._bpe = BPETokenizer(pre_tok, self.token_to_id, merges)
        else:
            raise ModelFileError(f"{source}: {_KEY}model: unsupported tokenizer '{kind}' (supported: llama, gpt2)")

        def checked(value, default):
            """The metadata id if it is in range, else llama.cpp's default for this tokenizer."""
            for v in (value, default):
                if v is not None and 0 <= int(v) < self.n_vocab:
                    return int(v)
            return None

        self.bos = checked(bos, default_bos)
        self.eos = checked(eos, default_eos)
        self.unk = checked(unk, default_unk)
        self.pad = checked(pad, None)
        self.eot = checked(eot, None)
        self.eom = checked(eom, None)
        if self.add_bos and self.bos is None:
            raise ModelFileError(f"{source}: {_KEY}add_bos_token is set but there is no valid bos_token_id")
        if self.add_eos and self.eos is None:
            raise ModelFileError(f"{source}: {_KEY}add_eos_token is set but there is no valid eos_token_id")
        self._detect_special_tokens()
        self._pieces: dict[int, bytes] = {}  # token_to_piece(id, special=True), lazily
        self._byte_ids: dict[int, int] = {}

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_gguf(cls, gf) -> "Vocab":
        """Build from a kvchat.runtime.gguf.file.GGUFFile (only its .metadata and .path are used)."""
        md = gf.metadata
        source = str(getattr(gf, "path", "<gguf>"))
        model = md.get(_KEY + "model")
        kinds = {"llama": "spm", "gpt2": "bpe"}
        if model not in kinds:
            raise ModelFileError(f"{source}: {_KEY}model: unsupported tokenizer '{model}' (supported: llama, gpt2)")
        tokens = md.get(_KEY + "tokens")
        if tokens is None:
            raise ModelFileError(f"{source}: {_KEY}tokens: missing (the file has no vocabulary)")
        return cls(
            kind=kinds[model],
            tokens=tokens,
            token_types=md.get(_KEY + "token_type"),
            scores=md.get(_KEY + "scores"),
            merges=md.get(_KEY + "merges"),
            pre=md.get(_KEY + "pre"),
            bos=md.get(_KEY + "bos_token_id"),
            eos=md.get(_KEY + "eos_token_id"),
            eot=md.get(_KEY + "eot_token_id"),
            eom=md.get(_KEY + "eom_token_id"),
            unk=md.get(_KEY + "unknown_token_id"),
            pad=md.get(_KEY + "padding_token_id"),
            add_bos=md.get(_KEY + "add_bos_token"),
            add_eos=md.get(_KEY + "add_eos_token"),
            add_space_prefix=md.get(_KEY + "add_space_prefix"),
            source=source,
        )

    def _find_first(self, texts) -> int | None:
        for t in texts:
            tid = self.token_to_id.get(t)
            if tid is not None:
                return tid
        return None

    def _mark_control(self, tid: int) -> None:
        """llama.cpp treats end-of-turn-looking tokens as control tokens whatever the file says."""
        self.attrs[tid] |= ATTR_CONTROL

    def _detect_special_tokens(self) -> None:
        """EOT/EOM/FIM by text when the metadata is silent, then the EOG set, then the special cache."""
        if self.eot is None:
            self.eot = self._find_first(_EOT_TEXTS)
        if self.eom is None:
            self.eom = self._find_first(_EOM_TEXTS)
        for tid in (self.eot, self.eom):
            if tid is not None:
                self._mark_control(tid)
        eog: set[int] = set()
        for texts in (_FIM_PAD_TEXTS, _FIM_REP_TEXTS, _FIM_SEP_TEXTS):
            tid = self._find_first(texts)
            if tid is not None:
                self._mark_control(tid)
                eog.add(tid)
        for text in _EOG_TEXTS:
            tid = self.token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                self._mark_control(tid)
        eog.update(t for t in (self.eos, self.eot, self.eom) if t is not None)
        # gpt-oss / solar: "<|end|>" ends a message, not the generation, when these exist
        texts = {self.tokens[t] for t in eog}
        if "<|end|>" in texts and (({"<|return|>", "<|call|>"} <= texts) or ({"<|calls|>", "<|flush|>"} <= texts)):
            end = self.token_to_id["<|end|>"]
            eog.discard(end)
            self.attrs[end] = ATTR_USER_DEFINED
        # "</s>" is an ordinary token (not an end) in vocabularies that have these markers
        if texts & {"<|tool_response>", "<|plamo:eos|>"} and "</s>" in texts:
            eog.discard(self.token_to_id["</s>"])
            self.attrs[self.token_to_id["</s>"]] = ATTR_NORMAL
        self.eog: set[int] = eog

        special = np.nonzero(self.attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))[0].tolist()
        # longest text first (llama.cpp compares byte lengths), so "<|im_end|>" beats "<|im"
        byte_len = self.tokens.byte_len  # the UTF-8 length (surrogate escapes are one byte each)
        special.sort(key=lambda t: -byte_len(t))
        self._special_all = [(self.tokens[t], t) for t in special]
        self._special_user = [
            (text, t) for text, t in self._special_all if not self.attrs[t] & (ATTR_CONTROL | ATTR_UNKNOWN)
        ]

    # ---------------------------------------------------------------- queries

    def is_eog(self, tid: int) -> bool:
        return tid in self.eog

    def is_control(self, tid: int) -> bool:
        return bool(self.attrs[tid] & ATTR_CONTROL)

    def token_text(self, tid: int) -> str:
        return self.tokens[tid]

    # ---------------------------------------------------------------- tokenize

    def _partition(self, text: str, parse_special: bool) -> list:
        """Cut `text` at special-token texts: a list of str (raw text) and int (token id) fragments."""
        fragments: list = [text]
        for tok_text, tid in self._special_all if parse_special else self._special_user:
            if tok_text not in text:
                continue
            out = []
            for frag in fragments:
                if not isinstance(frag, str) or tok_text not in frag:
                    out.append(frag)
                    continue
                parts = frag.split(tok_text)
                for k, part in enumerate(parts):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    def _byte_token(self, b: int) -> int:
        tid = self._byte_ids.get(b)
        if tid is None:
            tid = self.token_to_id.get(f"<0x{b:02X}>")
            if tid is None:
                tid = self.token_to_id.get(chr(b))
            if tid is None:
                raise ModelFileError(f"{self.source}: vocabulary has no byte token for 0x{b:02X}")
            self._byte_ids[b] = tid
        return tid

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text` exactly as llama_tokenize(text, add_special, parse_special) gives them.

        Text that is not valid UTF-8 (lone or surrogate-escaped surrogates) is cleaned first:
        each bad byte becomes U+FFFD, as llama.cpp's unicode_cpts_from_utf8 does."""
        text = clean_text(text)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos)
        fragments = self._partition(text, parse_special) if text else []
        if self.kind == "spm":
            prev_special = True  # the first fragment counts as following a special token
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(
                    spm_tokenize(frag.replace(" ", _SPACE_ESCAPE), self.token_to_id, self.scores, self._byte_token)
                )
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._bpe.tokenize(frag))
        if add_special and self.add_eos:
            out.append(self.eos)
        return out

    # ---------------------------------------------------------------- detokenize

    def _piece(self, tid: int) -> bytes:
        """The bytes of a token as llama.cpp renders it with special=True (cached)."""
        piece = self._pieces.get(tid)
        if piece is not None:
            return piece
        attr = int(self.attrs[tid])
        text = self.tokens[tid]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED):
            piece = text.encode("utf-8")
        elif attr & ATTR_NORMAL:
            if self.kind == "spm":
                piece = text.replace(_SPACE_ESCAPE, " ").encode("utf-8")
            else:
                piece = byte_decode(text)
                if piece is None:  # characters outside the byte alphabet: llama.cpp marks them
                    piece = b"".join(
                        byte_decode(c)
                        or b"[UNK_BYTE_0x" + c.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
                        for c in text
                    )
        elif attr & ATTR_BYTE:
            piece = bytes([int(text[3:5], 16)])
        else:
            piece = b""  # unused / undefined tokens render as nothing
        self._pieces[tid] = piece
        return piece

    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        """Raw bytes of one token; control/unknown tokens give b"" unless `special`."""
        if not 0 <= tid < self.n_vocab:
            raise ValueError(f"token id {tid} out of range 0..{self.n_vocab - 1}")
        if not special and self.attrs[tid] & (ATTR_CONTROL | ATTR_UNKNOWN):
            return b""
        return self._piece(tid)

    def detokenize_bytes(self, ids, special: bool = False, remove_special: bool = False) -> bytes:
        """llama_detokenize(ids, remove_special, unparse_special=special) as bytes."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos:
            ids = ids[:-1]
        parts = []
        for tid in ids:
            piece = self.token_to_piece(tid, special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        text = b"".join(parts)
        return clean_spaces(text) if self.clean_spaces else text

    def detokenize(self, ids, special: bool = False, remove_special: bool = False) -> str:
        """Text of a token sequence (invalid UTF-8 becomes U+FFFD)."""
        return self.detokenize_bytes(ids, special, remove_special).decode("utf-8", errors="replace")
