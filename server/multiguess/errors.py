"""Errors users can act on. Each says what is wrong and what to do about it."""


class MultiguessError(Exception):
    """Base class: every error the engine raises on purpose."""


class ModelLoadError(MultiguessError):
    """A model or tokenizer could not be found or loaded."""


class UnsupportedModelError(MultiguessError):
    """The architecture has no native fast path."""


class IncompatibleDraftError(MultiguessError):
    """The draft's tokenizer does not match the target's: its tokens would mean other things."""


class InvalidRequestError(MultiguessError, ValueError):
    """A prompt or sampling parameter is out of range."""


class EngineConfigError(MultiguessError, ValueError):
    """An engine setting does not fit the model: a context length above the model's own, say."""


class InsufficientMemoryError(EngineConfigError):
    """The models, their activations and one sequence's KV cache do not fit the device memory allowed."""
