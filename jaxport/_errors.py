"""Error types shared by both halves of jaxport.

Every error a user can cause derives from `JaxportError`; the CLI prints its message on one
line and exits non-zero, with no traceback. Messages name the file, key or argument, what was
received, what was expected, and what to do.
"""


class JaxportError(Exception):
    """Base class of errors caused by input (files, arguments, weights), not by bugs."""


class CheckpointError(JaxportError, ValueError):
    """A checkpoint or variables file cannot be read, or holds something it should not."""


class ConversionError(JaxportError, ValueError):
    """Weights do not fit the architecture they are converted for."""


class ConfigError(JaxportError, ValueError):
    """An argument or setting has an invalid value."""


class DivergedError(JaxportError, ArithmeticError):
    """Training produced a non-finite loss or weights; nothing non-finite was saved."""
