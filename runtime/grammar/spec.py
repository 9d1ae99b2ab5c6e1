"""What the user asked the answer to look like, compiled and checked before any model loads.

A `GrammarSpec` is one of: a JSON schema (`-j`, `--json-schema-file`, a request's "json_schema"),
any JSON object (`--json`), or a GBNF grammar (`--grammar`, `--grammar-file`; llama.cpp's format,
converted to Lark by llguidance's `gbnf_to_lark`, its character runs made single lexemes where
that changes nothing but speed (lexemes.py); a Lark grammar passes as it is). `compile()` turns it into
llguidance's grammar text and validates it without a tokenizer, so a bad schema or grammar is
refused with one line saying what and where (`GrammarError`, exit 2) before the model loads.

JSON output is compact on one line (`{"a": 1, "b": [2, 3]}`): llguidance allows any run of
whitespace between JSON tokens by default, and a small model at temperature 0 can spend its
whole answer on newlines there; a schema's own "x-guidance" options still win. An object schema
that lists its "properties" without saying "additionalProperties" gets only those properties, as
llama.cpp's json-schema-to-grammar reads it (JSON Schema itself would allow any others, and
SmolLM2 then invents "skills": [...] without end); every such answer is valid against the schema
as written. Say "additionalProperties": true to allow more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvchat.runtime.errors import GrammarError

JSON_OBJECT = '{"type": "object"}'
# llguidance's JSON compiler options (applied before the schema's own "x-guidance")
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "gbnf")


@dataclass(frozen=True)
class GrammarSpec:
    """kind: json_schema | gbnf; text: the schema / grammar source; origin: where it came
    from, for messages ("--json-schema", "schema.json", "prompts.jsonl:3")."""

    kind: str
    text: str
    origin: str

    def compile(self) -> str:
        """llguidance's grammar text for this spec; GrammarError (one line) when it is invalid."""
        return compile_grammar(self)

    def describe(self) -> str:
        """A short name for notices: "JSON schema from F", "any JSON object", "GBNF grammar"."""
        if self.kind == "json_schema":
            return "any JSON object" if self.text == JSON_OBJECT else f"JSON schema ({self.origin})"
        return f"grammar ({self.origin})"


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def compile_grammar(spec: GrammarSpec) -> str:
    import llguidance

    M = llguidance.LLMatcher
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as e:
            raise GrammarError(
                f"{spec.origin}: the JSON schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
            ) from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(
                f"{spec.origin}: a JSON schema must be an object or a boolean, not {type(schema).__name__}"
            )
        try:
            grammar = M.grammar_from_json_schema(closed_objects(schema), defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{spec.origin}: bad JSON schema: {_one_line(e)}") from None
        what = "JSON schema"
    elif spec.kind == "gbnf":
        from kvchat.runtime.grammar.lexemes import gbnf_to_lark_with_runs

        try:  # a Lark grammar (`start:` or `%llguidance`) passes as it is, as with llama.cpp's backend
            grammar = M.grammar_from_lark(gbnf_to_lark_with_runs(spec.text))
        except Exception as e:  # GbnfToLarkError and kin: the message carries line and position
            raise GrammarError(f"{spec.origin}: bad GBNF grammar: {_one_line(e)}") from None
        what = "GBNF grammar"
    else:
        raise GrammarError(f"{spec.origin}: unknown grammar kind {spec.kind!r} (one of {', '.join(KINDS)})")
    is_error, messages = M.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise GrammarError(f"{spec.origin}: bad {what}: {_one_line(messages[0] if messages else 'rejected')}")
    return grammar


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "not", "contains", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema):
    """A copy of `schema` where every object listing "properties" without "additionalProperties"
    allows no other properties (llama.cpp's reading; module docstring). allOf members are left
    as they are: closing each part would make their union impossible."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(x) for x in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    return out


def read_spec_file(path: Path, kind: str, flag: str) -> GrammarSpec:
    """A schema or grammar file's spec; GrammarError when it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GrammarError(f"{flag} {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    return GrammarSpec(kind, text, str(path))


def spec_from_flags(
    json_schema: str | None = None,
    json_schema_file: Path | None = None,
    grammar: str | None = None,
    grammar_file: Path | None = None,
    any_json: bool = False,
) -> GrammarSpec | None:
    """The one spec the command line asks for (None: free text); GrammarError for two at once
    or one that does not compile."""
    given = [
        name
        for name, value in (
            ("--json-schema", json_schema),
            ("--json-schema-file", json_schema_file),
            ("--grammar", grammar),
            ("--grammar-file", grammar_file),
            ("--json", any_json or None),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise GrammarError(f"give one of {', '.join(given)}, not several")
    if json_schema is not None:
        spec = GrammarSpec("json_schema", json_schema, "--json-schema")
    elif json_schema_file is not None:
        spec = read_spec_file(json_schema_file, "json_schema", "--json-schema-file")
    elif grammar is not None:
        spec = GrammarSpec("gbnf", grammar, "--grammar")
    elif grammar_file is not None:
        spec = read_spec_file(grammar_file, "gbnf", "--grammar-file")
    elif any_json:
        spec = GrammarSpec("json_schema", JSON_OBJECT, "--json")
    else:
        return None
    spec.compile()
    return spec
