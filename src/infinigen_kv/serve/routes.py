"""The endpoints of the OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (plain and SSE
streaming), /health and /metrics. `Service` (on app.state) holds what they share: the engine, the model id, the
limits, the counters; turning a request into a job and a job's events into the response."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.concurrency import run_in_threadpool

from .engine import Engine
from .jobs import SHUTDOWN_MESSAGE, Job, QueueFull, ShuttingDown, TooLarge
from .errors import RETRY, APIError
from .schemas import ChatRequest, CompletionRequest

router = APIRouter()


class Service:
    """What the endpoints share, made once by create_app."""

    def __init__(self, engine: Engine, model_id: str, api_key: str | None, max_tokens_limit: int,
                 aliases: tuple[str, ...] = ()):
        self.engine, self.model_id, self.api_key, self.max_tokens_limit = engine, model_id, api_key, max_tokens_limit
        self.aliases = frozenset(aliases)  # other names requests may give the model by (the path it was loaded from)
        self.registry = registry = engine.metrics.registry  # the engine's histograms and gauges, and these counters
        self.prompt_tokens = Counter("infinigen_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.completion_tokens = Counter("infinigen_completion_tokens", "generated tokens of finished requests",
                                         registry=registry)
        self.cancelled = Counter("infinigen_cancelled_requests", "requests whose client left before the end",
                                 registry=registry)
        self.started = int(time.time())  # /v1/models' "created"

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)", code="invalid_api_key")

    def check_model(self, name: str) -> None:
        if name != self.model_id and name not in self.aliases:
            raise APIError(404, f"model {name!r} not found; this server serves {self.model_id!r}", "model",
                           "model_not_found")

    def make_job(self, req, ids: list[int], field: str, max_tokens: int | None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, echo: bool = False) -> Job:
        refused = req.refused()
        if refused:
            raise APIError(400, refused[1], refused[0], "unsupported_parameter")
        if not ids:
            raise APIError(400, "the prompt is empty", field, "empty_prompt")
        vocab = self.engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in (req.logit_bias or {})):
            raise APIError(400, f"logit_bias: token ids must be in [0, {vocab})", "logit_bias", "invalid_value")
        if req.n > self.engine.max_batch:
            raise APIError(400, f"n={req.n} is over this server's limit of {self.engine.max_batch} (--max-batch)", "n",
                           "invalid_value")
        ctx = self.engine.context
        if max_tokens is None:
            max_tokens = min(self.max_tokens_limit, (ctx - len(ids)) if ctx else self.max_tokens_limit)
        if max_tokens > self.max_tokens_limit:
            raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of {self.max_tokens_limit}",
                           "max_tokens", "invalid_value")
        if ctx and len(ids) + max(max_tokens, 1) > ctx:
            raise APIError(400, f"the prompt has {len(ids)} token{'s' if len(ids) != 1 else ''} and max_tokens is "
                                f"{max_tokens}: more than the "
                                f"model's context of {ctx} tokens", field, "context_length_exceeded")
        job = Job(ids, max_tokens, req.temperature, req.top_p, req.seed, list(req.stop or []), logprobs,
                  top_k=max(req.top_k, 0), min_p=req.min_p, presence_penalty=req.presence_penalty,
                  frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                  logit_bias=req.logit_bias, ignore_eos=req.ignore_eos, n=req.n, echo=echo,
                  prompt_logprobs=prompt_logprobs)
        try:
            return self.engine.submit(job)
        except TooLarge as e:
            raise APIError(400, str(e), field, "pool_limit_exceeded") from None
        except ShuttingDown as e:
            raise APIError(503, f"{e}; retry on another server", code="shutting_down", headers=RETRY) from None
        except QueueFull as e:
            raise APIError(503, f"server busy: {e}; retry later", code="queue_full", headers={"Retry-After": "1"}) from None

    def usage(self, job: Job) -> dict:
        """OpenAI's usage, with the prompt tokens served from the prefix cache; where this server has none, why."""
        p, c = len(job.prompt_ids), job.completion_tokens
        out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
               "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}
        if self.engine.prefix_note is not None:
            out["prefix_cache"] = self.engine.prefix_note
        return out

    def account(self, job: Job) -> None:
        self.prompt_tokens.inc(len(job.prompt_ids))
        self.completion_tokens.inc(job.completion_tokens)

    async def collect(self, job: Job, request: Request) -> list[tuple[str, str, list | None, list | None]]:
        """Per choice: (text, finish_reason, logprob entries, prompt logprob entries) of a job; the job is
        cancelled (its rows freed at the next step) if the client leaves first."""
        parts = [[] for _ in range(job.n)]
        entries = [[] if job.logprobs is not None else None for _ in range(job.n)]
        prompt, finish = [None] * job.n, [None] * job.n
        watch = asyncio.ensure_future(disconnected(request))
        try:
            while None in finish:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self.cancelled.inc()
                    raise APIError(499, "the client closed the connection")  # nobody reads it
                kind, value, lps, i = get.result()
                if kind == "prompt":
                    prompt[i] = lps
                    continue
                if lps:
                    entries[i].extend(lps)
                if kind == "text":
                    parts[i].append(value)
                elif kind == "done":
                    finish[i] = value
                else:
                    if value == SHUTDOWN_MESSAGE:
                        raise APIError(503, value, code="shutting_down", headers=RETRY)
                    raise APIError(500, value)
            self.account(job)
            return [("".join(p), f, e, pr) for p, f, e, pr in zip(parts, finish, entries, prompt)]
        finally:
            watch.cancel()
            job.cancelled = True  # a no-op once done; frees the place if this request was cancelled

    def sse(self, job: Job, chunk, include_usage: bool) -> StreamingResponse:
        """chunk(text or None, finish_reason or None, first, logprob entries or None, choice index, kind) -> the
        OpenAI chunk (kind "prompt": the echoed prompt, with its logprob entries if asked)."""

        async def events():
            finished, left = False, job.n
            try:
                for i in range(job.n):
                    yield f"data: {json.dumps(chunk(None, None, True, None, i, 'text'))}\n\n"
                while True:
                    kind, value, lps, i = await job.events.get()
                    if kind in ("text", "prompt"):
                        yield f"data: {json.dumps(chunk(value, None, False, lps, i, kind))}\n\n"
                    elif kind == "done":
                        yield f"data: {json.dumps(chunk(None, value, False, lps, i, kind))}\n\n"
                        left -= 1
                        if left:
                            continue
                        finished = True
                        self.account(job)
                        if include_usage:
                            last = {**chunk(None, None, False, None, 0, kind), "choices": [], "usage": self.usage(job)}
                            yield f"data: {json.dumps(last)}\n\n"
                        break
                    else:
                        finished = True
                        code = "shutting_down" if value == SHUTDOWN_MESSAGE else None
                        err = {"message": value, "type": "server_error", "param": None, "code": code}
                        yield f"data: {json.dumps({'error': err})}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:
                if not finished:
                    job.cancelled = True
                    self.cancelled.inc()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def authorize(request: Request) -> None:
    request.app.state.service.authorize(request)


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.get("/health")
async def health(request: Request):
    svc = request.app.state.service
    state = {"model": svc.model_id, "method": svc.engine.method, "queue_depth": svc.engine.queue_depth,
             "replica": os.getpid()}  # which process answered (several behind a proxy: Ray Serve)
    if not svc.engine.admitting:  # draining for shutdown: load balancers should stop sending
        return JSONResponse({"status": "draining", **state}, 503, headers=RETRY)
    return {"status": "ok", **state}

@router.get("/metrics", dependencies=[Depends(authorize)])
async def metrics(request: Request):
    return Response(generate_latest(request.app.state.service.registry), media_type=CONTENT_TYPE_LATEST)

@router.get("/v1/models", dependencies=[Depends(authorize)])
async def models(request: Request):
    svc = request.app.state.service
    return {"object": "list", "data": [{"id": svc.model_id, "object": "model", "created": svc.started,
                                        "owned_by": "infinigen-kv"}]}

@router.post("/v1/completions", dependencies=[Depends(authorize)])
async def completions(req: CompletionRequest, request: Request):
    svc = request.app.state.service
    engine, model_id = svc.engine, svc.model_id
    svc.check_model(req.model)
    if isinstance(req.prompt, str):
        ids = await run_in_threadpool(engine.encode, req.prompt)
        prompt_text = req.prompt
    else:
        vocab = engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt):
            raise APIError(400, f"token ids must be in [0, {vocab})", "prompt", "invalid_value")
        ids = list(req.prompt)
        prompt_text = await run_in_threadpool(engine.decode, ids) if req.echo else ""
    job = svc.make_job(req, ids, "prompt", req.max_tokens, req.logprobs,
                   req.logprobs if req.echo and req.logprobs is not None else None, echo=req.echo)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    offset = [0] * req.n  # per choice: characters of token text reported so far (text_offset)

    def legacy(entries, i):  # the completions API's logprobs object
        if entries is None:
            return None
        tokens = [e["token"] for e in entries]
        starts = [offset[i] + sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
        offset[i] += sum(len(t) for t in tokens)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [None if e["top_logprobs"] is None else
                                 {a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
                "text_offset": starts}

    def chunk(text, finish, first, entries, i=0, kind="text"):
        if kind == "prompt":  # the echo, and its tokens' logprobs if asked
            text, entries = prompt_text, entries if req.logprobs is not None else None
        return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                "choices": [{"index": i, "text": text or "", "logprobs": legacy(entries, i),
                             "finish_reason": finish}]}

    if req.stream:
        return svc.sse(job, chunk, bool(req.stream_options and req.stream_options.include_usage))
    choices = []
    for i, (text, finish, entries, prompt) in enumerate(await svc.collect(job, request)):
        if req.echo:
            entries = None if entries is None else (prompt or []) + entries
            text = prompt_text + text
        choices.append({"index": i, "text": text, "logprobs": legacy(entries, i), "finish_reason": finish})
    return {"id": rid, "object": "text_completion", "created": created, "model": model_id, "choices": choices,
            "usage": svc.usage(job)}

@router.post("/v1/chat/completions", dependencies=[Depends(authorize)])
async def chat(req: ChatRequest, request: Request):
    svc = request.app.state.service
    engine, model_id = svc.engine, svc.model_id
    svc.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    messages = [m.plain() for m in req.messages]
    try:
        ids = await run_in_threadpool(engine.chat_ids, messages)
    except Exception as e:  # a template that refuses the conversation (e.g. roles out of order)
        raise APIError(400, f"messages: the chat template refused them: {e}", "messages", "invalid_value") from None
    job = svc.make_job(req, ids, "messages", req.max_completion_tokens or req.max_tokens,
                   (req.top_logprobs or 0) if req.logprobs else None)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(text, finish, first, entries, i=0, kind="text"):
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        lps = None if entries is None else {"content": entries, "refusal": None}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                "choices": [{"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}]}

    if req.stream:
        return svc.sse(job, chunk, bool(req.stream_options and req.stream_options.include_usage))
    choices = [{"index": i, "message": {"role": "assistant", "content": text},
                "logprobs": None if entries is None else {"content": entries, "refusal": None},
                "finish_reason": finish}
               for i, (text, finish, entries, _) in enumerate(await svc.collect(job, request))]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model_id, "choices": choices,
            "usage": svc.usage(job)}
