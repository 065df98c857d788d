"""The one user-facing error type: the CLI prints its message on one line and exits 2."""


class AttnlabError(Exception):
    """A problem the user can fix (bad input, missing file, wrong option), stated in one line."""
