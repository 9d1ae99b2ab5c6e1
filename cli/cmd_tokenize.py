"""Placeholder until the module's owner lands it (registers no command yet)."""


def register(app):
    pass
