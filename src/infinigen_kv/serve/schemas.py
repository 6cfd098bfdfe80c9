"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic. Every field either acts or is
refused with a 400 naming it: a client must never get other output than it asked for without a sign. Fields
that change no output (user, metadata, ...) are accepted and ignored; unknown fields are refused."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, field_validator


def _unicode(v: str) -> str:
    """JSON may escape a lone surrogate ("\\ud800"): valid JSON, not text a tokenizer can take."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode text (a lone surrogate such as \\ud800)") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: StrictBool = False


# fields OpenAI clients send that change no output here: accepted, ignored
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier"}


class _Common(BaseModel):
    # strict: JSON types as the API documents them ("5" is not an integer, 5.0 neither; an integer is a number);
    # unknown fields allowed here, then refused by `refused`, naming the field
    model_config = ConfigDict(extra="allow", strict=True)

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias in [-100, 100]
    ignore_eos: StrictBool = False
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # what a torch generator takes
    stream: StrictBool = False  # "yes" is not a boolean
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # choices; at most the server's --max-batch (checked by the app)
    # accepted only in the form that asks nothing of us: refused, naming the field, rather than ignored
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v:
            raise ValueError("tools are not supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none"):
            raise ValueError("tool_choice is not supported (only \"none\")")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        if v is not None and v.get("type") != "text":
            raise ValueError("response_format is not supported (only {\"type\": \"text\"})")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for token, bias in (v or {}).items():
            if not token.strip().isdigit():
                raise ValueError(f"keys must be token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias}")
        return {int(t): b for t, b in v.items()} if v else None

    def refused(self) -> tuple[str, str] | None:
        """(field, message) of the first field this request sets that the server cannot honour, or None. (Here,
        not in a validator, so that the 400 names the field in `param`.)"""
        for name in self.model_extra or {}:
            if name not in IGNORED:
                return name, f"field {name!r} is not supported"
        return None


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[int]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo (scoring)
    logprobs: int | None = Field(None, ge=0, le=5)  # each token's logprob and this many alternatives
    echo: StrictBool = False  # the prompt before the completion (with logprobs: the prompt tokens' too)
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported (no fill-in-the-middle)")
        return v

    def refused(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1, self.n):
            return "best_of", "best_of is not supported other than 1 or n (no server-side ranking)"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 needs echo: true (scoring the prompt)"
        return super().refused()

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and (len(v) == 0 or (isinstance(v[0], str) and len(v) != 1)):
            raise ValueError("exactly one prompt per request (a string or a list of token ids)")
        return v[0] if isinstance(v, list) and isinstance(v[0], str) else v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[dict] | None = None  # a string, or text parts [{"type": "text", "text": ...}]

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported (only text)")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text part needs a string 'text'")
                _unicode(part["text"])
        return v

    def plain(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p["text"] for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: StrictBool = False  # each token's logprob ...
    top_logprobs: int | None = Field(None, ge=0, le=20)  # ... and this many alternatives (needs logprobs)
