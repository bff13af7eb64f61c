"""FastAPI routes: the OpenAI-compatible API over an Engine.

POST /v1/completions, POST /v1/chat/completions (stream: true -> server-sent
events in OpenAI's chunk format, then `data: [DONE]`), GET /v1/models,
GET /health, GET /metrics (Prometheus). Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status: bad JSON,
bad parameters, unknown model, a prompt over the context limit (400/404),
a missing or wrong API key (401), a full queue (429).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashmem.serve.auth import OPEN_SALT, bearer
from flashmem.serve.engine import Engine, Event, QueueFullError, Sampling, Sequence

# Chat template of models whose tokenizer has none (the tiny test models): one
# "role: content" line per message, then "assistant:" for the reply.
FALLBACK_CHAT_TEMPLATE = "{role}: {content}\n"
# Seconds without an event after which a stream sends an SSE comment.
KEEPALIVE_S = 10.0
# How often a non-streaming request asks whether its client is still there.
DISCONNECT_CHECK_S = 0.5


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def create_app(engine: Engine, *, api_keys: dict[str, str] | None = None, default_max_tokens: int = 16) -> FastAPI:
    """The app over `engine` (started and stopped with the app). api_keys: key -> tenant salt
    (None: no authentication, one tenant)."""

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="flashmem", lifespan=lifespan)  # type: ignore[arg-type]
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return _error(400, "malformed JSON in the request body", code="json_invalid")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(
            exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error"
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    def tenant(request: Request) -> str:
        if api_keys is None:
            return OPEN_SALT
        key = bearer(request.headers.get("authorization"))
        if key is None or key not in api_keys:
            raise ApiError(
                401,
                "missing or invalid API key (Authorization: Bearer KEY)",
                "authentication_error",
                code="invalid_api_key",
            )
        return api_keys[key]

    def check_model(name: str) -> None:
        if name != engine.model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {engine.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.model_name, "active": engine.active}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant(request)
        return {"object": "list", "data": [_model_card(engine.model_name)]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        salt = tenant(request)
        check_model(body.model)
        ids = _prompt_ids(engine, body.prompt)
        return await _generate(
            request, engine, body, ids, salt, chat=False, max_tokens=body.max_tokens or default_max_tokens
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        salt = tenant(request)
        check_model(body.model)
        ids = chat_prompt_ids(engine.tokenizer, [m.model_dump() for m in body.messages])
        mt = body.max_completion_tokens or body.max_tokens or default_max_tokens
        return await _generate(request, engine, body, ids, salt, chat=True, max_tokens=mt)

    return app


# ---------------------------------------------------------------- prompts
def _prompt_ids(engine: Engine, prompt: str | list[int] | list[str]) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "a list of prompts is not supported; send one prompt per request", param="prompt")
        prompt = str(prompt[0])
    if isinstance(prompt, str):
        ids = list(engine.tokenizer(prompt).input_ids)
    else:
        ids = [int(x) for x in prompt]
        vocab = engine.model.config.get_text_config(decoder=True).vocab_size
        if any(x < 0 or x >= vocab for x in ids):
            raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The model's chat template with the assistant's turn opened; FALLBACK_CHAT_TEMPLATE
    when the tokenizer has none."""
    msgs = [{"role": m["role"], "content": _content_text(m.get("content"))} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    text = "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in msgs) + "assistant:"
    return list(tokenizer(text).input_ids)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ApiError(
                400, f"message content of type {part.get('type')!r} is not supported; only text", param="messages"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


# ---------------------------------------------------------------- generation
async def _generate(
    request: Request, engine: Engine, body: _Common, ids: list[int], salt: str, *, chat: bool, max_tokens: int
) -> Response:
    if len(ids) + 1 > engine.max_context:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens; this model's context is {engine.max_context} tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop: up to 4 non-empty strings", param="stop")
    max_tokens = min(max_tokens, engine.max_context - len(ids))
    sampling = Sampling(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=stop
    )
    seq = Sequence(ids, sampling, salt, asyncio.get_running_loop())
    try:
        engine.submit(seq)
    except QueueFullError as exc:
        raise ApiError(429, str(exc), "rate_limit_error", code="queue_full") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(seq, engine, rid, created, chat, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    text, finish, error = await _collect(seq, request)
    if error is not None:
        raise ApiError(500 if finish == "error" else 503, error, "server_error")
    usage = _usage(seq)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return JSONResponse(
        {"id": rid, "object": obj, "created": created, "model": engine.model_name, "choices": [choice], "usage": usage}
    )


async def _collect(seq: Sequence, request: Request) -> tuple[str, str | None, str | None]:
    """Wait for the whole answer; a client that hangs up cancels the sequence (checked
    every DISCONNECT_CHECK_S, whether or not tokens are arriving)."""
    assert seq.events is not None
    parts: list[str] = []
    next_check = time.monotonic() + DISCONNECT_CHECK_S
    try:
        while True:
            try:
                ev = await asyncio.wait_for(seq.events.get(), timeout=DISCONNECT_CHECK_S)
            except TimeoutError:
                ev = None
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    seq.cancel()
                    return "".join(parts), "cancelled", "client disconnected"
            if ev is None:
                continue
            parts.append(ev.text)
            if ev.finish_reason is not None:
                return "".join(parts), ev.finish_reason, ev.error
    finally:
        if not seq.done.is_set():
            seq.cancel()


async def _stream(
    seq: Sequence, engine: Engine, rid: str, created: int, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events; the `finally` runs when the client disconnects (the response
    task is cancelled), which frees the sequence and its cache at the worker's next round."""
    assert seq.events is not None
    obj = "chat.completion.chunk" if chat else "text_completion"
    first = True

    def chunk(text: str | None, finish: str | None) -> str:
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        data = {"id": rid, "object": obj, "created": created, "model": engine.model_name, "choices": [choice]}
        if include_usage:
            data["usage"] = None
        return f"data: {json.dumps(data)}\n\n"

    try:
        while True:
            try:
                ev: Event = await asyncio.wait_for(seq.events.get(), timeout=KEEPALIVE_S)
            except TimeoutError:
                # An SSE comment: clients ignore it, but their read timeouts restart
                # while a long prefill (or the queue) keeps the first token away.
                yield ": keep-alive\n\n"
                continue
            if ev.error is not None and ev.finish_reason in ("error", "cancelled"):
                yield f"data: {json.dumps({'error': {'message': ev.error, 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
                break
            if ev.text or first:
                yield chunk(ev.text, None)
                first = False
            if ev.finish_reason is not None:
                yield chunk(None, ev.finish_reason)
                if include_usage:
                    data = {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": engine.model_name,
                        "choices": [],
                        "usage": _usage(seq),
                    }
                    yield f"data: {json.dumps(data)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        if not seq.done.is_set():
            seq.cancel()


def _usage(seq: Sequence) -> dict[str, Any]:
    return {
        "prompt_tokens": seq.prompt_tokens,
        "completion_tokens": len(seq.generated),
        "total_tokens": seq.prompt_tokens + len(seq.generated),
        "prompt_tokens_details": {"cached_tokens": seq.reused_tokens},
    }


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "flashmem"}


def _error(
    status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status
    )
