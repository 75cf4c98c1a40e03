"""Exceptions raised for bad arguments.

They subclass both the Python category (ValueError / TypeError) and RuntimeError, so code written
against torch.nn.functional (which raises RuntimeError for the same mistakes) keeps working.
"""


class InvalidArgument(ValueError, RuntimeError):
    """A shape, value or device that the operation does not accept."""


class InvalidDtype(TypeError, RuntimeError):
    """A dtype that the operation (or the backend serving the device) does not accept."""


class InvalidDim(InvalidArgument, IndexError):
    """A ``dim`` out of range for the input: also an IndexError, as torch raises for the same call."""
