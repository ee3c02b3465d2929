"""Exceptions of the lightkeeper package.

Every error carries the library's machine-readable reason code (``code``: "invalid_argument",
"aborted", "deadline_exceeded", ...) beside its message; branch on the code, never on the text.
"""


class Error(RuntimeError):
    """A Lightkeeper call failed; ``code`` says why, ``message`` says it in words."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class QuorumLost(Error):
    """A collective was cut short: a member of the quorum failed (a failure notice aborted the
    communicator), a peer died, or the collective ran past its deadline. The buffer's content
    is unspecified. Poll for the next quorum and retry the step on it."""
