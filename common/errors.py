"""Error types that cross module boundaries; each carries a one-line, user-facing message."""


class SplitserveError(Exception):
    """Base of every error the project raises on purpose; `str(err)` is the one-line message."""


class ModelLoadError(SplitserveError):
    """Weights are missing, corrupt, or of an architecture the engine does not implement."""


class InvalidRequestError(SplitserveError):
    """A request cannot be served as asked (prompt over the context, bad sampling values, ...)."""


class CapacityError(SplitserveError):
    """The KV cache cannot hold what was asked, even when empty."""
