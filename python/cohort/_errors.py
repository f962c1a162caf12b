"""The exceptions cohort raises; the extension module builds them."""


class CohortError(RuntimeError):
    """A run or a tool failed; the message is cohort's, causes included."""


class ConfigError(ValueError):
    """A config did not validate.

    ``str(error)`` is what the ``cohort`` command prints: every problem
    found, at once. ``errors`` holds each as a ``(file, key, message)``
    tuple, ``key`` the dotted config key (``None`` for a file-level
    problem).
    """

    def __init__(self, message, errors=()):
        super().__init__(message)
        self.errors = [tuple(e) for e in errors]
