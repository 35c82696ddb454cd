"""The engine's warning category and error type, shared by every backend and entry point."""


class MPPCAWarning(UserWarning):
    """Something the user should know about the run (few samples, capped extent, non-finite voxels...)."""


class MPPCAInputError(ValueError):
    """The input cannot be denoised as asked. The message is one sentence meant for the user."""


class GPUOutOfMemoryError(MPPCAInputError):
    """``denoise(device="cuda")`` ran out of GPU memory even in the smallest batches; ``reason`` says so
    without the advice the message adds (for a caller that goes on on the CPU itself)."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}; free the GPU or use device 'cpu'")
        self.reason = reason

    def __reduce__(self):  # pickled (from the GPU worker to a node) as made: from its reason
        return type(self), (self.reason,)

    @property
    def fallback_note(self) -> str:
        """The sentence a caller that goes on on the CPU reports (as ``denoise(device="auto")`` warns it)."""
        return f"{self.reason}; running on the CPU instead"


def is_out_of_memory(err: BaseException) -> bool:
    """Whether an exception from the GPU engine means the device ran out of memory: torch's
    OutOfMemoryError, or cuSOLVER/CUDA reporting a failed allocation (told apart by their text, so that
    this needs neither torch nor nvmath to answer)."""
    text = f"{type(err).__name__}: {err}"
    return ("OutOfMemoryError" in text or "out of memory" in text.lower() or "ALLOC_FAILED" in text
            or "CUDA_ERROR_OUT_OF_MEMORY" in text)
