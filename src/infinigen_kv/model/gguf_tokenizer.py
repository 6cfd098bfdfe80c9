"""A GGUF's tokenizer as a `tokenizers` Tokenizer: the vocabulary, merges, special tokens and chat template of its
metadata, split as llama.cpp splits the text for its pre-tokenizer type. Built once a file and saved as
tokenizer.json beside the model's config (model/load.py); nothing here imports transformers.

- "gpt2" vocabularies (Qwen2, Llama 3, SmolLM2): byte-level BPE with the file's merges, the text first split by the
  regular expressions llama.cpp uses for the file's `tokenizer.ggml.pre` (SmolLM2's splits digits one by one, as its
  own tokenizer.json does); Llama 3's kind takes a whole word that is a token before any merge (`ignore_merges`).
- "llama" vocabularies (SentencePiece: Gemma, Llama 2, Mistral): BPE with byte fallback, the merges recovered from
  the vocabulary (each token cut in two known pieces, ranked by the token's score; Gemma's by its place in the file,
  its scores do not follow its merge order), spaces as U+2581 (Gemma: no prefix space; the others: one before the
  text, as SentencePiece adds it).
Tokens the file marks as control are special (kept whole, dropped by skip_special_tokens); user-defined ones are
kept whole. The beginning-of-sequence token is prepended where the file says to add it.
"""

from __future__ import annotations

from .gguf import GGUF

CONTROL, USER_DEFINED = 3, 4

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]  # llama.cpp's for a BPE file of no known kind

# tokenizer.ggml.pre -> (the splits in order, whole words first, BOS by default), as llama.cpp reads them
_LLAMA3 = ([LLAMA3], True, True)
_QWEN2 = ([QWEN2], False, False)
_GPT2 = ([GPT2], False, False)
_DIGITS = ([r"\p{N}", GPT2], False, False)
_GPT4O = ([GPT4O], True, False)
PRE = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), ([LLAMA3], False, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan"), _QWEN2),
    "qwen35": ([QWEN35], False, False),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _DIGITS),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "tekken": ([TEKKEN], True, True),
    "default": (DEFAULT, False, False),
}


class GGUFTokenizerError(ValueError):
    """The GGUF holds no tokenizer this package builds."""


def build(g: GGUF):
    """(tokenizers.Tokenizer, tokenizer_config: {bos_token, eos_token, unk_token, pad_token, chat_template}) of the
    GGUF's vocabulary."""
    kind = g.get("tokenizer.ggml.model")
    tokens = g.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError(f"{g.path} holds no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok, add_bos = _byte_level(g, tokens)
    elif kind == "llama":
        tok, add_bos = _sentencepiece(g, tokens)
    else:
        raise GGUFTokenizerError(f"{g.path}: GGUF tokenizer {kind!r} is not supported (gpt2 and llama are)")
    _add_special(tok, tokens, types, byte_level=kind == "gpt2")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", add_bos))
    bos = g.get("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None:
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], bos)])
    special = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= i < len(tokens):
            special[name] = tok.id_to_token(i)
    template = g.get("tokenizer.chat_template")
    if template:
        special["chat_template"] = template
    return tok, special


def _byte_level(g: GGUF, tokens: list):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for i, t in enumerate(tokens):  # a token outside the byte alphabet (a mislabel): spelled in it
        vocab.setdefault(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")), i)
    merges = []
    for m in g.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)
        if cut > 0:
            merges.append((m[:cut], m[cut + 1 :]))
    splits, whole_words, add_bos = PRE.get(g.get("tokenizer.ggml.pre") or "default", PRE["default"])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=whole_words))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, add_bos


def _sentencepiece(g: GGUF, tokens: list):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    gemma = g.architecture.startswith("gemma")
    if gemma:  # a token of spaces only is stored as spaces, looked up as U+2581s
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = g.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_of(vocab, scores), dropout=None, fuse_unk=True,
                               byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    else:
        prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok, True


def merges_of(vocab: dict, scores: dict) -> list:
    """A SentencePiece vocabulary's BPE merges: every cut of a token into two tokens, the token's cuts in the order
    of their pieces' ids, all ranked by the token's score (highest first; ties: longer left, then right piece)."""
    merges = []
    for token, score in scores.items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        cuts.sort(key=lambda c: (vocab[c[0]], vocab[c[1]]))
        merges.extend((left, right, score) for left, right in cuts)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special(tok, tokens: list, types: list, byte_level: bool) -> None:
    from tokenizers import AddedToken

    letters = set(_byte_alphabet().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == CONTROL and t and (letters is None or set(t) <= letters)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
            if k == USER_DEFINED and t and tok.token_to_id(t) is not None]
    if user:
        tok.add_tokens(user)


def _byte_alphabet() -> dict:
    """GPT-2's bytes -> printable characters (each byte one character: the vocabulary's spelling)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
