"""Structured output: a grammar (JSON schema, GBNF, Lark) constrains which tokens may be sampled.

The grammar engine is llguidance's (the library llama.cpp's optional `LLAMA_LLGUIDANCE` backend
uses); kvchat only gives it the model's vocabulary (tokenizer.py), compiles the user's grammar and
words its refusals (spec.py), and keeps one matcher per answered sequence (matcher.py) whose
token mask the sampler applies after the penalties and before top-k (runtime/sampling.py).
"""
