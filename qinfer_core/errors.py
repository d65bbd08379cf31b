class UserError(Exception):
    """A problem the user can fix: a missing or corrupt file, a model of another shape, settings that cannot work.

    Every layer raises this one class; the CLI prints its message as one line and exits with code 2.
    """
