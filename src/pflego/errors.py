"""User-facing errors: each becomes a one-line message and exit code 2 at the CLI."""


class PflegoError(Exception):
    """A problem with the user's input that training cannot start with.

    The message names what is wrong and how to fix it, on one line.
    """


class ConfigError(PflegoError):
    """An invalid or inconsistent configuration value."""


class DataError(PflegoError):
    """A missing, corrupt or unusable dataset file."""


class DivergedError(PflegoError):
    """Training diverged (non-finite parameters or updates, or a finite loss explosion under
    ``divergence=stop``); the CLI exits with code 3."""

    exit_code = 3
