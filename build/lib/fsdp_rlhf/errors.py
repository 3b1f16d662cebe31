"""Errors the CLI reports as one line (no traceback unless ``--debug``)."""


class UserError(Exception):
    """A problem with the user's input: flags, files, data, sizes."""
