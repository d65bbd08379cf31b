class PrepError(Exception):
    """A problem the user can fix (a missing file, a shape mismatch, an unsupported model).

    The CLI prints its message as one line and exits with code 2.
    """
