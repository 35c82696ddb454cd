"""The engine's warning category and error type, shared by every backend and entry point."""


class MPPCAWarning(UserWarning):
    """Something the user should know about the run (few samples, capped extent, non-finite voxels...)."""


class MPPCAInputError(ValueError):
    """The input cannot be denoised as asked. The message is one sentence meant for the user."""
