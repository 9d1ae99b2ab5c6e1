"""A grammar's own cost per token, without the model: llguidance's mask, its unpacking and following
the token, replayed over the tokens of real answers on SmolLM2's vocabulary, and the sampler with /
without the mask (docs/performance.md "Structured output"). Usage: python benchmarks/grammar_mask_replay.py
"""

import os
import statistics
import time

import numpy as np

from kvchat.runtime.gguf.file import GGUFFile
from kvchat.runtime.grammar.matcher import Constraint
from kvchat.runtime.grammar.spec import GrammarSpec
from kvchat.runtime.sampling import Sampler, SamplingParams
from kvchat.runtime.text.vocab import Vocab

v = Vocab.from_gguf(GGUFFile(os.path.expanduser("~/.cache/kvchat/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
t0 = time.perf_counter()
from kvchat.runtime.grammar.tokenizer import lltokenizer_for

lltokenizer_for(v)
print(f"tokenizer build {time.perf_counter() - t0:.2f} s")
PERSON = '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}'
story = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper named Tom. " * 6
cases = [
    ("json person", GrammarSpec("json_schema", PERSON, "j"), '{"name": "Sylvie", "age": 22}'),
    (
        "json story (long string)",
        GrammarSpec(
            "json_schema", '{"type":"object","properties":{"story":{"type":"string"}},"required":["story"]}', "s"
        ),
        '{"story": "' + story,
    ),
    ("gbnf char class", GrammarSpec("gbnf", "root ::= [a-zA-Z0-9 ,.;:!?'\"()-]+", "g"), story),
]
rng = np.random.default_rng(0)
logits = rng.standard_normal(v.n_vocab).astype(np.float32)
for name, spec, text in cases:
    c = Constraint(spec, v)
    ids = v.tokenize(text, add_special=False)[:128]
    per = []
    samp = []
    for r in range(5):
        m = c.matcher()
        s = Sampler(SamplingParams(temp=0.0))
        t_s = 0.0
        for t in ids:
            a = m.allowed()
            t1 = time.perf_counter()
            s.sample(logits, None, allowed=a)
            t_s += time.perf_counter() - t1
            m.accept(t)
        per.append(m.seconds / len(ids))
        samp.append(t_s / len(ids))
    free = []
    for r in range(5):
        s = Sampler(SamplingParams(temp=0.0))
        t1 = time.perf_counter()
        for t in ids:
            s.sample(logits, None)
        free.append((time.perf_counter() - t1) / len(ids))
    print(
        f"{name}: {len(ids)} tokens, grammar (mask+unpack+follow) {statistics.median(per) * 1e3:.3f} ms/token, "
        f"sampler with mask {statistics.median(samp) * 1e3:.3f} ms/token "
        f"vs without {statistics.median(free) * 1e3:.3f} ms/token"
    )
