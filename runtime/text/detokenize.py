"""Token pieces to text, beside the vocabulary (runtime/text/vocab.py): llama.cpp's clean-up of
tokenization spaces (`clean_spaces`, used by Vocab.detokenize), and `StreamDecoder`, which turns a
stream of generated token ids into text emitting only complete UTF-8 characters."""

from __future__ import annotations

import codecs


def clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces: " ?" → "?", " ' " → "'", " 's" → "'s" and kin."""
    if not text:
        return text
    # pass 1: no space before ? ! . ,
    out = bytearray(text[:1])
    for i in range(1, len(text)):
        x = text[i]
        if text[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    # pass 2: a lone apostrophe between spaces loses both spaces
    # (the skipped space is zeroed in place, as llama.cpp does, so it cannot pair up again)
    src, out = bytearray(out), bytearray(out[:1])
    i = 1
    while i < len(src):
        x = src[i]
        if x == 0x27 and i + 1 < len(src) and src[i - 1] == 0x20 and src[i + 1] == 0x20:
            out.pop()
            out.append(x)
            src[i + 1] = 0
            i += 2
            continue
        out.append(x)
        i += 1
    # pass 3: no space before 's 'm 're 've
    src, out = bytes(out), bytearray(out[:1])
    for i in range(1, len(src)):
        x = src[i]
        if src[i - 1] == 0x20 and x == 0x27 and i + 1 < len(src):
            x1 = src[i + 1]
            if x1 in b"sm" or (i + 2 < len(src) and src[i + 1 : i + 3] in (b"re", b"ve")):
                out.pop()
        out.append(x)
    return bytes(out)


class StreamDecoder:
    """Turns a stream of token ids into text, emitting only complete UTF-8 characters.

    A character split over several byte tokens (emoji, CJK under byte fallback) is held back until
    its last byte arrives; bytes that can never form a character come out as U+FFFD. An answer
    that ends (-n, end of turn, Ctrl-C) inside a character drops the held bytes rather than
    printing a U+FFFD for a character that was never finished.
    """

    def __init__(self, vocab, special: bool = False):
        self.vocab = vocab
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tid: int) -> str:
        return self._decoder.decode(self.vocab.token_to_piece(tid, self.special))

    def flush(self) -> str:
        """End of the stream: the bytes of an unfinished character are dropped; resets the decoder."""
        self._decoder.reset()
        return ""
