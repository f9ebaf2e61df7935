"""Errors with fields, shown to the user as one line (a traceback only with --debug)."""

from __future__ import annotations


class GovernorError(Exception):
    """Base for every error the CLI reports as one clear line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
