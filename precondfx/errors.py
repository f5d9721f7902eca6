"""The one exception class of the package.

Every error precondfx raises on purpose is a :class:`PrecondError`, a ``ValueError`` subclass,
whose message says what was wrong and what to do about it.
"""


class PrecondError(ValueError):
    """Bad input or an unsupported model: the message says what was wrong and what to do."""
