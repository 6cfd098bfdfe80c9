"""Our model classes: one decoder for every supported architecture (hparams.ModelArgs says which facts apply), in
the style of gpt-fast's model.py. One forward serves a prompt chunk and a decode step: what a step shares (positions,
each window's mask, each RoPE, a static step's column) is built once into a `Step` (step.py) and passed to every
layer; what layer l's speculation starts for layer l+1 comes back from the cache and is kept in the layer loop's
`fetches`.

    Transformer.forward(ids (B, T), positions (B, T), mask (B, S) | None, cache) -> logits (B, T', V)
      x = embed(ids)                                         (B, T, D)
      for each Block:  h = norm(x)
                       fetches += cache.before_attention(i, h, step)     (speculation of what i+1 reads)
                       q, k, v = rope(wqkv(h))                           (B, H | G, T, d)
                       fetches[i] = fetches[i] or cache.after_query(i, q, step)   (or of what i reads, from q)
                       view = cache.layers[i].view(k, v, fetches[i])     (stores k, v; what attention reads)
                       x = x + wo(attend(q, view, step.mask(i)))
                       x = x + mlp(norm(x))
      logits = lm_head(norm(x))

Weights are held as the engine reads them (ops.py): float32, bfloat16 or int8 rows, q/k/v and gate/up merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import backend as backends
from . import ops
from .attention import attend_layer, attend
from .hparams import ModelArgs
from .rope import apply_rope, inv_freq
from .kv import KVView
from .step import Step, window_mask

# weights held apart from the compute dtype (CPU)
HELD = ("bfloat16", "int8", "int5", "int4")  # forms held apart from the compute dtype (ops.held_dtype)
EMBED_HELD = {"int4": "int8", "int5": "int8"}  # the embedding and LM head at more bits than the layers (as llama.cpp's
# Q4_K_M keeps its output layer in Q6_K); an embedding apart from the LM head is looked up a row at a time: int8 rows


@dataclass
class Output:
    logits: torch.Tensor


@dataclass(frozen=True)
class Proj:
    """One projection's rows of a merged weight (views): what speculation and calibration read of q_proj, k_proj."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor, backend) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, backend, prefill=x.numel() // x.shape[-1] > ops.SMALL_BATCH)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, weights: str | None, dtype: torch.dtype):
        super().__init__()
        wdtype = ops.held_dtype(in_features, weights, dtype)
        shape = (out_features, ops.held_width(in_features, weights))
        self.weight = nn.Parameter(torch.empty(shape, dtype=wdtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor, prefill: bool, backend, residual: torch.Tensor | None = None) -> torch.Tensor:
        p = self._parameters  # (not self.weight: nn.Module's attribute lookup, ~120 times a decode step)
        return ops.linear(x, p["weight"], p.get("bias"), backend, prefill, residual)


class Norm(nn.Module):
    def __init__(self, dim: int, kind: str, eps: float, dtype: torch.dtype):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False) if kind == "layer" else None

    def forward(self, x: torch.Tensor, backend) -> torch.Tensor:
        p = self._parameters
        if self.kind == "layer":
            return F.layer_norm(x, (x.shape[-1],), p["weight"], p.get("bias"), self.eps)
        return ops.rms_norm(x, p["weight"], self.eps, backend, plus_one=self.kind == "rms1p")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, weights, dtype: torch.dtype):
        super().__init__()
        H, G, d = args.n_heads, args.n_kv_heads, args.head_dim
        self.layer, self.n_heads, self.n_kv_heads, self.head_dim = layer, H, G, d
        self.window, self.scaling, self.q_scale = args.windows[layer], args.score_scale, args.q_scale
        self.wqkv = Linear(args.dim, (H + 2 * G) * d, args.qkv_bias, form(weights, f"layers.{layer}.attn.wqkv"), dtype)
        self.wo = Linear(H * d, args.dim, args.out_bias, form(weights, f"layers.{layer}.attn.wo"), dtype)
        norm = args.norm if args.norm != "layer" else "rms"
        self.q_norm = Norm(d, norm, args.norm_eps, dtype) if args.qk_norm else None
        self.k_norm = Norm(d, norm, args.norm_eps, dtype) if args.qk_norm else None
        self.rope = args.rope

    def _proj(self, start: int, size: int) -> Proj:
        w, b = self.wqkv.weight, self.wqkv.bias
        w = ops.part(w, start, size)
        return Proj(w, None if b is None else b[start : start + size])

    @property
    def q_proj(self) -> Proj:
        return self._proj(0, self.n_heads * self.head_dim)

    @property
    def k_proj(self) -> Proj:
        return self._proj(self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim)

    def query(self, x: torch.Tensor, rope, backend) -> torch.Tensor:
        """Queries for inputs x (B, T, D) as attention gets them: (B, H, T, d) (OPT's pre-scaling included)."""
        B, T, _ = x.shape
        q = self.q_proj(x, backend)
        q = (q * self.q_scale if self.q_scale != 1.0 else q).view(B, T, self.n_heads, self.head_dim)
        q = (self.q_norm(q, backend) if self.q_norm is not None else q).transpose(1, 2)
        return apply_rope(q, rope) if self.rope else q

    def key(self, x: torch.Tensor, rope, backend) -> torch.Tensor:
        """Keys for inputs x (B, T, D) as the cache stores them (after RoPE): (B, G, T, d)."""
        B, T, _ = x.shape
        k = self.k_proj(x, backend).view(B, T, self.n_kv_heads, self.head_dim)
        k = (self.k_norm(k, backend) if self.k_norm is not None else k).transpose(1, 2)
        return apply_rope(k, rope) if self.rope else k

    def qkv(self, h: torch.Tensor, rope, prefill: bool, backend) -> tuple:
        """q (B, H, T, d), k, v (B, G, T, d) of the normed input h (B, T, D), RoPE applied."""
        B, T, _ = h.shape
        H, G, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self._modules["wqkv"].forward(h, prefill, backend)  # (B, T, (H + 2G) d)
        kern = backend.ops if h.is_cpu and h.dtype == torch.float32 else None
        if T == 1 and self.rope and self.q_norm is None and kern is not None:  # q and k rotated in place, one call
            qkv = qkv.view(B, -1)
            kern.rope_(qkv, rope[0], rope[1], H + G)
            qkv = qkv.view(B, 1, H + 2 * G, d).transpose(1, 2)  # (B, H + 2G, 1, d)
            return qkv[:, :H], qkv[:, H : H + G], qkv[:, H + G :]
        q, k, v = qkv.view(B, T, H + 2 * G, d).split([H, G, G], dim=2)
        if self.q_scale != 1.0:  # OPT scales q before the scores
            q = q * self.q_scale
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q, backend), self.k_norm.forward(k, backend)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        return q, k.contiguous(), v.contiguous()

    def forward(self, h: torch.Tensor, step: Step, cache, fetch, residual: torch.Tensor | None) -> torch.Tensor:
        """h (B, T, D) normed -> (residual +) the output projection of attention over the cache's view."""
        B, T, _ = h.shape
        prefill = T > 1
        backend = step.backend
        q, k, v = self.qkv(h, step.rope(self.layer), prefill, backend)
        mask = step.layer_mask(self.layer)
        if cache is not None and fetch is None and not prefill:
            fetch = cache.after_query(self.layer, q, step)
        if cache is None:
            out, _ = attend(q, KVView(k, v), mask, self.scaling, backend, window=self.window)
        else:
            out = attend_layer(cache, self.layer, q, k, v, mask, self.scaling, self.window, fetch, backend,
                               step.column)
        return self._modules["wo"].forward(out.reshape(B, T, -1).contiguous(), prefill, backend, residual)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, weights, dtype: torch.dtype):
        super().__init__()
        self.act, self.hidden = args.act, args.intermediate
        w1, w2 = form(weights, f"layers.{layer}.mlp.w1"), form(weights, f"layers.{layer}.mlp.w2")
        if args.act == "relu":  # OPT: fc1 -> relu -> fc2
            self.w1 = Linear(args.dim, args.intermediate, args.mlp_bias, w1, dtype)
        else:  # gated: gate and up merged, (silu | gelu_tanh)(gate) * up
            self.w1 = Linear(args.dim, 2 * args.intermediate, args.mlp_bias, w1, dtype)
        self.w2 = Linear(args.intermediate, args.dim, args.mlp_bias, w2, dtype)

    def forward(self, h: torch.Tensor, prefill: bool, backend, residual: torch.Tensor | None) -> torch.Tensor:
        m = self._modules  # (nn.Module's attribute lookup is the slow path: ~120 times a decode step)
        a = m["w1"].forward(h, prefill, backend)
        if self.act == "relu":
            a = F.relu(a)
        elif self.act == "silu":
            if not prefill and backend.silu_lanes is not None and a.is_cpu and a.dtype == torch.float32:
                # (contiguous: a GEMM of a few rows may hand back its output transposed)
                gu = a.reshape(-1, a.shape[-1]).contiguous()
                a = backend.ops.silu_mul(gu, backend.silu_lanes).view(*a.shape[:-1], -1)
            else:  # (in place: a prompt chunk's (T, F) temporaries, the same bits)
                a = F.silu(a[..., : self.hidden].contiguous(), inplace=True).mul_(a[..., self.hidden :])
        else:
            a = F.gelu(a[..., : self.hidden], approximate="tanh") * a[..., self.hidden :]
        return m["w2"].forward(a, prefill, backend, residual)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, weights, dtype: torch.dtype):
        super().__init__()
        self.layer, self.pre_norm, self.sandwich = layer, args.pre_norm, args.sandwich
        self.attn = Attention(args, layer, weights, dtype)
        self.mlp = MLP(args, layer, weights, dtype)
        self.attn_norm = Norm(args.dim, args.norm, args.norm_eps, dtype)
        self.mlp_norm = Norm(args.dim, args.norm, args.norm_eps, dtype)
        if args.sandwich:  # Gemma 3: each sublayer's output normed before the residual add
            self.attn_post_norm = Norm(args.dim, args.norm, args.norm_eps, dtype)
            self.mlp_post_norm = Norm(args.dim, args.norm, args.norm_eps, dtype)

    @property
    def device(self) -> torch.device:
        return self.attn.wqkv.weight.device

    def forward(self, x: torch.Tensor, step: Step, cache, fetches: dict) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D); fetches: what earlier layers started for later ones (updated, this layer's taken)."""
        prefill, b = x.shape[1] > 1, step.backend
        m = self._modules  # (nn.Module's attribute lookup is the slow path: ~200 times a decode step)
        h = m["attn_norm"].forward(x, b) if self.pre_norm else x
        if cache is not None:
            fetches.update(cache.before_attention(self.layer, h, step))
        fetch = fetches.pop(self.layer, None)
        if self.sandwich:
            x = x + m["attn_post_norm"].forward(m["attn"].forward(h, step, cache, fetch, None), b)
            return x + m["mlp_post_norm"].forward(m["mlp"].forward(m["mlp_norm"].forward(x, b), prefill, b, None), b)
        x = m["attn"].forward(h, step, cache, fetch, x)  # x + attention
        if not self.pre_norm:
            x = m["attn_norm"].forward(x, b)
        h = m["mlp_norm"].forward(x, b) if self.pre_norm else x
        x = m["mlp"].forward(h, prefill, b, x)  # x + mlp
        return x if self.pre_norm else m["mlp_norm"].forward(x, b)


class Transformer(nn.Module):
    """A decoder-only model of any supported architecture. weights: how the linear and embedding weights are held:
    None (in `dtype`, as everything), or one form for all ("bfloat16", "int8", "int5" or "int4" rows: float32 compute
    on CPU, dtype float32; the embedding and LM head as EMBED_HELD says), or "file" (a GGUF at its own precision).
    plan: {weight's name ("layers.3.attn.wqkv", "embed", "lm_head"): form} where forms differ from weight to weight
    (gguf_model.plan); it overrides `weights`' forms. checkpoint: what names the checkpoint it was read from,
    whatever the form (calibrations are kept per checkpoint). backend: what runs its operations (model/backend.py;
    load_model builds it from its arguments; None: `backend.build` for its device at its first forward)."""

    def __init__(self, args: ModelArgs, weights: str | None = None, dtype: torch.dtype = torch.float32,
                 source: str | None = None, checkpoint: str | None = None, plan: dict | None = None,
                 backend: backends.Backend | None = None):
        super().__init__()
        self._backend = backend
        self.plan = dict(plan) if plan is not None else None
        self.args, self.weights, self.dtype = args, weights, dtype
        weights = self.plan if self.plan is not None else weights
        self.source = source  # the checkpoint directory it was loaded from (its tokenizer's), if any
        self.checkpoint = checkpoint
        self.mapped_from = None  # the key of the file the parameters are mapped from (model/mapped.py), if any
        self.placed = False  # layers on devices of their own (placement.place): the forward moves x between them
        E = args.embed_dim or args.dim
        ew = form(weights, "embed")  # how the embedding and LM head are held
        wdtype = ops.held_dtype(E, ew, dtype) if args.tie_embeddings or ew != "int8" else torch.int8
        self.embed = nn.Parameter(torch.empty(args.vocab_size, ops.held_width(E, ew), dtype=wdtype),
                                  requires_grad=False)
        self.positions = (nn.Parameter(torch.empty(args.max_positions + args.position_offset, args.dim, dtype=dtype),
                                       requires_grad=False) if args.position_offset else None)
        self.project_in = Linear(E, args.dim, False, None, dtype) if args.embed_dim else None
        self.project_out = Linear(args.dim, E, False, None, dtype) if args.embed_dim else None
        self.layers = nn.ModuleList(Block(args, i, weights, dtype) for i in range(args.n_layers))
        self.norm = Norm(args.dim, args.norm, args.norm_eps, dtype) if args.final_norm else None
        hw = form(weights, "lm_head")
        self.lm_head = self.embed if args.tie_embeddings else nn.Parameter(
            torch.empty(args.vocab_size, ops.held_width(E, hw), dtype=ops.held_dtype(E, hw, dtype)), requires_grad=False)
        for key, rope in args.ropes:
            self.register_buffer(_freq_name(key), inv_freq(rope, args.head_dim), persistent=False)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)`, `.half()`: the model then computes in its weights' new dtype; the rotary frequencies stay
        float32 (positions to 128k times a bfloat16 frequency would be off by whole turns)."""
        super()._apply(fn, recurse)
        if self.weights is None:
            self.dtype = self.embed.dtype
        for key, rope in self.args.ropes:
            name = _freq_name(key)
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, inv_freq(rope, self.args.head_dim).to(getattr(self, name).device))
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def backend(self) -> backends.Backend:
        """The backend its forwards run on (passed down in each Step): the one it was given, for its device."""
        kind = self.embed.device.type
        if self._backend is None:
            self._backend = backends.build(kind)
        elif self._backend.device_type != kind:
            self._backend = self._backend.on(kind)
        return self._backend

    @backend.setter
    def backend(self, backend: backends.Backend) -> None:
        self._backend = backend

    @property
    def config(self) -> ModelArgs:
        return self.args

    # --- one step's shared inputs -------------------------------------------------------------------------------

    def step_inputs(self, positions: torch.Tensor, mask: torch.Tensor | None, past: int,
                    column: torch.Tensor | None = None) -> Step:
        """The Step of a forward of positions (B, T) after `past` cached columns, mask (B, past + T) or None."""
        a, (B, T) = self.args, positions.shape
        ropes = {}
        for key, _ in a.ropes:
            freqs = positions[..., None].float() * getattr(self, _freq_name(key))  # (B, T, d/2)
            emb = torch.cat((freqs, freqs), dim=-1)
            ropes[key] = (emb.cos().to(self.dtype), emb.sin().to(self.dtype))
        if column is not None:  # a static step: mask (B, capacity) marks the valid columns (no windows)
            masks = {None: mask[:, None, None, :].bool()}
        else:
            masks = {w: window_mask(mask, B, T, past, w, positions.device) for w in dict.fromkeys(a.windows)}
        return Step(positions, mask, masks, ropes, a.rope_types, a.windows, self.backend, column)

    # --- the forward --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = True,
                logits_to_keep: int = 0, column: torch.Tensor | None = None, **_) -> Output:
        """input_ids (B, T) after the cache's past (past_key_values: one of our caches, or None: attention over this
        chunk alone); attention_mask (B, past + T) of the padded past and this chunk (None: nothing padded);
        position_ids (B, T) (default: counted on from the past); logits_to_keep: the last n positions' logits
        (0: all). column: a static step's device column (model/static.py). -> Output(logits (B, T', V))."""
        cache = past_key_values if use_cache else None
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        step = self.step_inputs(position_ids, attention_mask, past, column)
        x = self.embed_tokens(input_ids, position_ids)
        fetches = {}  # layer -> what an earlier layer's speculation started for it
        steps = {x.device: step}  # (layers placed across devices: the step on each)
        for block in self.layers:
            if self.placed and block.device != x.device:
                x = x.to(block.device)
                steps.setdefault(x.device, step.to(x.device))
            x = block.forward(x, steps[x.device], cache, fetches)  # (no module hooks: not __call__)
        if self.placed:
            x = x.to(self.lm_head.device)
        if isinstance(logits_to_keep, torch.Tensor):  # positions by index (none: no logits computed)
            x = x[:, logits_to_keep]
        elif logits_to_keep:
            x = x[:, -logits_to_keep:]
        return Output(self.logits(x))

    def embed_tokens(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, D) the first layer's input."""
        compute = compute_dtype(self)
        x = ops.embedding(ids, self.embed, compute)
        if self.args.embed_scale is not None:
            x = x * torch.tensor(self.args.embed_scale, dtype=compute)
        if self.project_in is not None:
            x = self.project_in(x, ids.shape[1] > 1, self.backend)
        if self.positions is not None:
            x = x + F.embedding(positions + self.args.position_offset, self.positions)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: x (B, T, D) -> (B, T, V). A few rows read a held head through the kernel
        (one read of a bfloat16 vocabulary, no float32 copy of it); more (a prompt scored) take the BLAS in float32
        products."""
        rows = x.numel() // x.shape[-1]
        if rows == 0:
            return x.new_empty(*x.shape[:-1], self.args.vocab_size)
        backend = self.backend
        if self.norm is not None:
            x = self.norm(x, backend)
        if self.project_out is not None:
            x = self.project_out(x, rows > 1, backend)
        held = self.lm_head.dtype != x.dtype
        logits = ops.linear(x, self.lm_head, None, backend, prefill=not (held and rows <= ops.SMALL_BATCH) and rows > 1,
                            bf16=False)  # (float32 products: logits a client scores, as echo's logprobs)
        cap = self.args.logit_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    def decode(self, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
               column: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step: ids (B,) at positions (B, 1), mask (B, n + 1) of the padded past and this token (None:
        nothing padded) -> logits (B, V), the cache appended to. A static step (model/static.py): mask (B, capacity)
        marks the valid columns and `column` (1,) is where the new rows go."""
        return self(input_ids=ids[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache,
                    column=column).logits[:, -1]


def form(weights: str | dict | None, name: str) -> str | None:
    """How weight `name` ("layers.3.attn.wqkv", "embed", "lm_head") is held under `weights` (a form or a plan)."""
    if isinstance(weights, dict):
        return weights.get(name)
    return EMBED_HELD.get(weights, weights) if name in ("embed", "lm_head") else weights


def _freq_name(key) -> str:
    return f"inv_freq_{key or 'global'}"


def compute_dtype(model) -> torch.dtype:
    """The dtype a model computes in: float32 for weights held in bfloat16 or as int8 rows, else its weights'."""
    return torch.float32 if model.weights in HELD or model.weights == "file" else model.dtype

