"""Exceptions of the lightkeeper package.

Every error carries the library's machine-readable reason code (``code``: "invalid_argument",
"aborted", "deadline_exceeded", ...) and the wire's finer one (``reason``:
"GROUP_SIZE_MISMATCH", ...) beside its message; branch on the codes, never on the text.
"""


class Error(RuntimeError):
    """A Lightkeeper call failed; ``code`` says why, ``message`` says it in words."""

    def __init__(self, code: str, message: str, reason: str = "UNSPECIFIED") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        # The wire's reason code behind it, e.g. "GROUP_SIZE_MISMATCH" (the lighthouse refused
        # this group's trainer count); "UNSPECIFIED" when none came with it.
        self.reason = reason


class InvalidArgument(Error, ValueError):
    """A call's arguments were refused (code ``invalid_argument``): by the package's own checks
    (``sync_every=0``, a tensor of a dtype it does not take, a call before the poll it needs) or
    by the C++ library (LK_ERR_INVALID_ARGUMENT: an unknown ``outer_compress``, a group rank not
    below the group size, ...). It is a ``ValueError`` too, so code written for plain Python
    (``except ValueError``) catches it, and an ``Error`` with ``code == "invalid_argument"``, so
    code that branched on the code keeps working."""

    def __init__(self, message: str, reason: str = "UNSPECIFIED") -> None:
        super().__init__("invalid_argument", message, reason)


class QuorumLost(Error):
    """A collective was cut short: a member of the quorum failed (a failure notice aborted the
    communicator), a peer died, or the collective ran past its deadline. The buffer's content
    is unspecified. Poll for the next quorum and retry the step on it."""


def error_of(code: str, message: str, reason: str = "UNSPECIFIED") -> Error:
    """The exception for a library error: ``InvalidArgument`` for "invalid_argument", else
    ``Error`` (the compiled module raises through this, so both sides map codes alike)."""
    if code == "invalid_argument":
        return InvalidArgument(message, reason)
    return Error(code, message, reason)


__all__ = ["Error", "InvalidArgument", "QuorumLost", "error_of"]
