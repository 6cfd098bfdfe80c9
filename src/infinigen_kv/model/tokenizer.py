"""A checkpoint's tokenizer read with the `tokenizers` library (tokenizer.json) and its chat template rendered with
jinja2, as transformers' fast tokenizers do: the same ids, the same text, the same prompts, without importing
transformers. The calls the package makes keep transformers' names (`tok(texts, return_tensors="pt")`,
`decode`, `apply_chat_template`), so code written for either takes this one.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


class TokenizerError(ValueError):
    """The checkpoint has no tokenizer this package reads (tokenizer.json)."""


def _token(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Encoding(dict):
    """What a call returns: input_ids (and attention_mask), by key or attribute, as transformers' BatchEncoding."""

    __getattr__ = dict.__getitem__


class Tokenizer:
    padding_side = "left"  # decode batches are left-padded (runtime/generation.py)

    def __init__(self, tok, config: dict | None = None, chat_template: str | None = None):
        self.backend_tokenizer = tok
        config = config or {}
        self.chat_template = chat_template or config.get("chat_template")
        self.bos_token, self.eos_token = _token(config.get("bos_token")), _token(config.get("eos_token"))
        self.unk_token = _token(config.get("unk_token"))
        self.pad_token = _token(config.get("pad_token")) or self.eos_token
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        config = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = path / "chat_template.jinja"
        chat = template.read_text() if template.is_file() else None
        return cls(Backend.from_file(str(path / "tokenizer.json")), config, chat)

    # --- ids of the special tokens ----------------------------------------------------------------------------

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # --- text <-> ids -----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text, return_tensors: str | None = None, padding: bool = False, add_special_tokens: bool = True,
                 **_) -> Encoding:
        """ids of a text (a list of ids) or of texts (a list of lists; padding: left-padded to the longest, with an
        attention mask); return_tensors="pt": as (B, n) tensors."""
        single = isinstance(text, str)
        rows = [self.encode(t, add_special_tokens) for t in ([text] if single else text)]
        n = max((len(r) for r in rows), default=0)
        if padding or return_tensors == "pt" and len({len(r) for r in rows}) > 1:
            masks = [[0] * (n - len(r)) + [1] * len(r) for r in rows]
            rows = [[self.pad_token_id or 0] * (n - len(r)) + r for r in rows]
        else:
            masks = [[1] * len(r) for r in rows]
        if return_tensors == "pt":
            import torch

            return Encoding(input_ids=torch.tensor(rows, dtype=torch.long).view(len(rows), -1),
                            attention_mask=torch.tensor(masks, dtype=torch.long).view(len(rows), -1))
        return Encoding(input_ids=rows[0] if single else rows, attention_mask=masks[0] if single else masks)

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, rows, skip_special_tokens: bool = False, **_) -> list[str]:
        return [self.decode(r, skip_special_tokens) for r in rows]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    # --- chat ---------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            return_dict: bool = False, **kwargs):
        """The chat template rendered over messages (a prompt string), or its ids (tokenize=True: without adding
        special tokens again: the template writes them; return_dict: as {"input_ids", "attention_mask"})."""
        if not self.chat_template:
            raise TokenizerError("the tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
                   "pad_token": self.pad_token}
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{**special, **kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids


def _generation_tag():
    """{% generation %}...{% endgeneration %} (transformers marks the assistant's text with it): its body as is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return Generation


def _compile(source: str):
    """The template in a sandbox, with the functions and filters transformers gives chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _generation_tag()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
