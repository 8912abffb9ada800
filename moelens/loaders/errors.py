"""Errors raised for bad checkpoints; each names the file and tensor at fault."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: missing, unexpected, misshapen or unreadable tensors."""


class CheckpointWarning(UserWarning):
    """A checkpoint that loads, but not as stored: integer or float8 tensors cast, NaN or Inf values."""
