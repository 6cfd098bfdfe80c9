"""The API's errors: {"error": {message, type, param, code}} with the status they go with."""

from __future__ import annotations

from fastapi.responses import JSONResponse

RETRY = {"Retry-After": "5"}  # a server shutting down: another one (or this one, restarted) will take it
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
               503: "server_error", 500: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)
