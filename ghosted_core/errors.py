"""The one user-facing error type of the project."""


class GhostedError(Exception):
    """Bad input or an unavailable resource, explained for the user.

    The message says what was wrong and what to try instead. `cli.main` prints it as one
    line on stderr with exit code 2; the app re-raises it as `gr.Error`. Any other exception
    is a bug and keeps its traceback.
    """
