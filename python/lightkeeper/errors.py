"""Exceptions of the lightkeeper package.

Every error carries the library's machine-readable reason code (``code``: "invalid_argument",
"aborted", "deadline_exceeded", ...) and the wire's finer one (``reason``:
"GROUP_SIZE_MISMATCH", ...) beside its message; branch on the codes, never on the text.
"""


class Error(RuntimeError):
    """A Lightkeeper call failed; ``code`` says why, ``message`` says it in words."""

    def __init__(self, code: str, message: str, reason: str = "UNSPECIFIED"):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        # The wire's reason code behind it, e.g. "GROUP_SIZE_MISMATCH" (the lighthouse refused
        # this group's trainer count); "UNSPECIFIED" when none came with it.
        self.reason = reason


class QuorumLost(Error):
    """A collective was cut short: a member of the quorum failed (a failure notice aborted the
    communicator), a peer died, or the collective ran past its deadline. The buffer's content
    is unspecified. Poll for the next quorum and retry the step on it."""
