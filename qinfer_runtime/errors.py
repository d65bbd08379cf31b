class RunError(Exception):
    """A model file the runtime cannot use, or run settings that cannot work; the CLI prints it as one line."""
