"""Errors that carry enough context to become an OpenAI-style API error."""

from __future__ import annotations


class ExoLikeError(Exception):
    """Base class: `status` and `type` map straight onto the API error body."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(ExoLikeError):
    status = 400
    type = "invalid_request_error"


class ModelNotFoundError(ExoLikeError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = "model", code: str | None = "model_not_found"):
        super().__init__(message, param=param, code=code)


class UnsupportedModelError(ExoLikeError):
    """The checkpoint exists but its architecture or settings are not implemented."""

    status = 400
    type = "invalid_request_error"


class AuthenticationError(ExoLikeError):
    """The node runs with --api-key and the request did not present it."""

    status = 401
    type = "invalid_request_error"  # OpenAI's type for a bad key (Anthropic's shape says authentication_error)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "invalid_api_key"):
        super().__init__(message, param=param, code=code)


class ServiceUnavailableError(ExoLikeError):
    status = 503
    type = "service_unavailable"
    retry_after: int | None = None  # seconds the client may wait before asking again (the Retry-After header)


class StageFailedError(ExoLikeError):
    """A stage's engine failed while running a request: a server fault, not the client's."""

    status = 500
    type = "server_error"


class StageStalledError(ExoLikeError):
    """A stage has spent longer than --step-timeout in one engine step: its engine is most likely hung."""

    status = 504
    type = "server_error"


class ModelPendingError(ServiceUnavailableError):
    """The model's description is still being fetched (a wait, not a problem)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "model_preparing"):
        super().__init__(message, param=param, code=code)


class ModelAccessError(ExoLikeError):
    """The hub refuses this node the model's files: gated or private, and no (accepted) token."""

    status = 401  # as the hub answers; the body's code `gated_model` tells it apart from a bad API key
    type = "permission_error"


class HubUnavailableError(ServiceUnavailableError):
    """The hub cannot be reached (or offline mode is on) and the cache lacks what is needed."""


class DownloadError(ExoLikeError):
    """A file could not be fetched intact (a server fault, not the client's)."""

    status = 502
    type = "server_error"


class ModelLoadingError(ServiceUnavailableError):
    """A non-streamed request's model is still being fetched and loaded after the wait such requests are given."""

    def __init__(self, message: str, retry_after: int, *, param: str | None = "model",
                 code: str | None = "model_loading"):
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after


class InsufficientMemoryError(ServiceUnavailableError):
    """A model does not fit in the memory the cluster's nodes offer beside the instances serving requests."""

    def __init__(self, message: str, *, param: str | None = "model", code: str | None = "insufficient_memory"):
        super().__init__(message, param=param, code=code)


class InsufficientDiskError(ExoLikeError):
    status = 507
    type = "server_error"
