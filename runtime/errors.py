"""User-facing error types.

Everything a user can cause (a bad file, a bad flag, a broken template, an unreadable session)
raises a subclass of KvchatError with a one-line message saying what, where and what to do; the
CLI prints it without a traceback. Anything else escaping is a bug and keeps its traceback.
"""


class KvchatError(Exception):
    """Base of all errors whose message is meant for the user."""


class ModelFileError(KvchatError):
    """A GGUF file is malformed, truncated, or describes a model we cannot run."""


class ChatTemplateError(KvchatError):
    """A chat template failed to render or tried to leave its sandbox."""


class SessionError(KvchatError):
    """A session file cannot be read, or belongs to another model or cache configuration."""


class CParamsError(KvchatError, ValueError):
    """Context parameters that cannot work together (a user's flags)."""


class ModelOutputError(KvchatError):
    """The model computed logits no sampler can use (NaN / +inf): its weights are damaged."""


class GrammarError(KvchatError):
    """A JSON schema or grammar (--json-schema, --grammar, a request's "json_schema") that cannot
    be compiled: a usage error, refused before the model loads (exit code 2)."""

    exit_code = 2
