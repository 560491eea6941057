"""Exceptions raised by megamoe."""


class MegaMoEError(RuntimeError):
    """Base class of every megamoe error (bad input, library failure)."""


class NotBuiltError(MegaMoEError, NotImplementedError):
    """A backend or precision that this version of megamoe does not implement yet."""


class LibraryError(MegaMoEError):
    """libmegamoe returned a failure status; the message is the library's own."""

    def __init__(self, function: str, status: str, message: str):
        super().__init__(f"{function} failed ({status}): {message}")
        self.function = function
        self.status = status
