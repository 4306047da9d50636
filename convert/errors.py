"""The one error type the tool raises for bad input or a refused operation.

The CLI turns it into a single line and exit code 2, so a user never sees a traceback for
something that is their input's fault, and a test can assert on the exact message.
"""


class ConvertError(Exception):
    """A user-facing error: the message names the file, tensor or module and what is wrong."""
