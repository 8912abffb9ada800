"""Errors raised for bad checkpoints; each names the file and tensor at fault."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: missing, unexpected, misshapen or unreadable tensors."""
