"""`kvchat tokenize -m MODEL [--parse-special] [--no-bos] TEXT`: print the token ids as a JSON list.

Only the vocabulary is read (no weights are touched), so this is quick even for large models; the
ids are those llama.cpp's llama-tokenize prints for the same flags.
"""

import json
import sys
from typing import Optional

import typer

from kvchat.cli.option_params import hf_option
from kvchat.cli.options import MODEL_HELP
from kvchat.cli.sources.models import resolve_model
from kvchat.runtime.gguf.split import open_gguf
from kvchat.runtime.text.vocab import Vocab


def register(app: typer.Typer) -> None:
    @app.command("tokenize")
    def tokenize(
        text: str = typer.Argument(..., help='text to tokenize; "-" reads it from stdin'),
        model: str = typer.Option(None, "-m", "--model", help=MODEL_HELP),
        hf: Optional[str] = hf_option(),
        parse_special: bool = typer.Option(
            False, "--parse-special", help="turn texts like <|im_start|> into their special tokens"
        ),
        no_bos: bool = typer.Option(False, "--no-bos", help="do not add the BOS/EOS tokens the model asks for"),
    ):
        """Print the token ids of TEXT as a JSON list."""
        if text == "-":
            from kvchat.runtime.text.utf8 import read_stream

            text = read_stream(sys.stdin)
        path = resolve_model(model, hf=hf)
        with open_gguf(path) as gf:
            vocab = Vocab.from_gguf(gf)
        ids = vocab.tokenize(text, add_special=not no_bos, parse_special=parse_special)
        print(json.dumps(ids))
