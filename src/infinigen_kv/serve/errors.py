"""The API's errors: {"error": {message, type, param, code}} with the status they go with."""

from __future__ import annotations

import re

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


# what a pydantic type error expected, in the words of a JSON user; a field with a wording of its own
EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
            "list_type": "a list", "dict_type": "an object", "model_type": "an object",
            "model_attributes_type": "an object", "none_required": "null"}
FIELD_EXPECTED = {"content": "a string or a list of content parts", "prompt": "a string or a list of token ids",
                  "stop": "a string or a list of strings"}


# pydantic's bounds, said as a JSON user would: (words, the bound's key in the error's ctx)
BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
          "less_than": ("<", "lt"), "too_short": ("at least", "min_length"), "too_long": ("at most", "max_length")}


def _json_kind(value) -> str:
    for kind, name in ((type(None), "null"), (bool, "a boolean"), (int, "an integer"), (float, "a number"),
                       (str, "a string"), (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            if kind is list and value:  # what it holds: a list of token ids is one thing, of objects another
                return f"a list holding {_json_kind(value[0])}"
            return name
    return "something else"


def _bound(error: dict, where: str) -> str | None:
    """`n` must be >= 1, got 0; `messages` must have at least 1 item, got 0: a bound pydantic checked."""
    words, key = BOUNDS.get(error.get("type"), (None, None))
    ctx = error.get("ctx") or {}
    if words is None or key not in ctx:
        return None
    got = error.get("input")
    if key in ("min_length", "max_length"):
        n = ctx[key]
        return f"'{where}' must have {words} {n} item{'s' if n != 1 else ''}, got {len(got) if hasattr(got, '__len__') else got}"
    return f"'{where}' must be {words} {ctx[key]}, got {got}"


def _path(loc) -> tuple[str, str]:
    """(the field as a user writes it, e.g. messages[0].content; its top-level name) from a pydantic location,
    without "body" and the union members pydantic names (str, list[...], function-after[...])."""
    out, top = "", None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and part.isidentifier() and part not in ("str", "int", "float", "bool", "dict", "list"):
            out += ("." if out else "") + part
            top = top or part
    return out, top


def validation_error(errors: list[dict], content_type: str | None) -> JSONResponse:
    """A 400 saying what was wrong with a request body in the user's words: the field, what it should be and what
    it was (`Invalid type for 'messages[0].content': expected a string or a list of content parts, but got an
    integer instead.`), or that the body must be a JSON object."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    where, top = _path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return error_response(400, "the body is not valid JSON", None, "invalid_json")
    if not where:
        if "json" not in (content_type or ""):
            return error_response(400, "send a JSON body with Content-Type: application/json", None, "invalid_body")
        return error_response(400, "the body must be a JSON object", None, "invalid_body")
    here = [e for e in errors if _path(e.get("loc", ()))[0] == where]  # a union: one error per member
    base = re.sub(r"(\[\d+\])+$", "", where)  # prompt[0] -> prompt: a union's list member erred in an item
    field = base.rsplit(".", 1)[-1]
    if field in FIELD_EXPECTED and any(e.get("type") in EXPECTED for e in errors):
        got = next((e.get("input") for e in errors if _path(e.get("loc", ()))[0] == base), first.get("input"))
        message = f"Invalid type for '{base}': expected {FIELD_EXPECTED[field]}, but got {_json_kind(got)} instead."
        return error_response(400, message, top, "invalid_type")
    if all(e.get("type") in EXPECTED for e in here):
        words = list(dict.fromkeys(EXPECTED[e["type"]] for e in here))
        expected = None
        message = (f"Invalid type for '{where}': expected {expected or ' or '.join(words)}, "
                   f"but got {_json_kind(first.get('input'))} instead.")
        return error_response(400, message, top, "invalid_type")
    bound = _bound(first, where)
    if bound is not None:
        return error_response(400, bound, top, "invalid_value")
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return error_response(400, f"{where}: {msg}", top, "invalid_value" if first.get("type") == "value_error"
                          else first.get("type"))
