"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic. Unknown fields are ignored, as
OpenAI clients send many; the ones we cannot honour (n > 1, several prompts) are refused explicitly."""

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
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # what a torch generator takes
    stream: StrictBool = False  # "yes" is not a boolean
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
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

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=5)  # each token's logprob and this many alternatives

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and (len(v) == 0 or (isinstance(v[0], str) and len(v) != 1)):
            raise ValueError("exactly one prompt per request (a string or a list of token ids)")
        return v[0] if isinstance(v, list) and isinstance(v[0], str) else v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    def plain(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: StrictBool = False  # each token's logprob ...
    top_logprobs: int | None = Field(None, ge=0, le=20)  # ... and this many alternatives (needs logprobs)
