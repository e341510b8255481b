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


class ServiceUnavailableError(ExoLikeError):
    status = 503
    type = "service_unavailable"


class StageFailedError(ExoLikeError):
    """A stage's engine failed while running a request: a server fault, not the client's."""

    status = 500
    type = "server_error"
