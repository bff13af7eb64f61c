"""FastAPI routes: the OpenAI-compatible API over an Engine.

POST /v1/completions, POST /v1/chat/completions (stream: true -> server-sent
events in OpenAI's chunk format, then `data: [DONE]`), GET /v1/models,
GET /health, GET /metrics (Prometheus). Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status: bad JSON,
bad parameters, unknown model, a prompt over the context limit (400/404),
a missing or wrong API key (401), a body over the size limit (413), a full
queue (429).

No request can hold the event loop, the model worker or other requests:
- a request body over `max_body_bytes` (default 4 MiB, `--max-request-bytes`)
  is refused with 413 before it is parsed (its bytes are read and dropped, never
  kept);
- prompt text (a completion's prompt, or all chat messages together) longer
  than `max_prompt_bytes` UTF-8 bytes cannot fit the context and gets 400
  `context_length_exceeded` without being tokenized. The bound is
  context x the longest token's bytes (x 4 when the tokenizer normalizes
  text): no tokenization of more bytes can give fewer tokens than the context;
- tokenization runs on a small pool of its own threads (each with its own copy
  of the tokenizer), never on the event loop or the model's worker thread;
- invalid Unicode (a lone surrogate such as "\ud800") and seeds outside int64
  are 400s naming the parameter.

OpenAI parameters that change the output are implemented (`logit_bias`,
`presence_penalty`, `frequency_penalty`, `seed`, `stop`, `temperature`,
`top_p`) or refused with 400 naming them (`echo`, `logprobs`, `top_logprobs`,
`suffix`, `best_of` > 1, tools, response formats other than text, and the
common non-OpenAI sampling extensions); none is accepted and ignored.
`max_tokens` with the prompt beyond the context is 400 `context_length_exceeded`
(without `max_tokens` the answer stops at the context's end).

With `api_keys`, `/docs`, `/redoc` and `/openapi.json` need a key like the API
(the schema names every route and parameter); without, they are open. `/health`
and `/metrics` are always open (no prompt text in either).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
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
# Largest request body accepted (bytes); more gets 413 before parsing.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# A body over the limit is read and dropped up to this many bytes (so the client
# reads its 413 instead of a reset connection), then the connection closes.
DRAIN_BYTES = 64 * 2**20
# Threads that tokenize prompts (off the event loop and the model worker).
TOKENIZE_THREADS = 4
INT64 = 2**63
# OpenAI parameters that would change the output and that this server does not implement.
UNSUPPORTED = {
    "echo": "echo",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "suffix": "suffix",
    "best_of": "best_of",
    "tools": "tool calls",
    "tool_choice": "tool calls",
    "functions": "function calls",
    "function_call": "function calls",
    "response_format": "response formats other than text",
    "top_k": "top_k (not an OpenAI parameter)",
    "min_p": "min_p (not an OpenAI parameter)",
    "repetition_penalty": "repetition_penalty (not an OpenAI parameter; use frequency_penalty)",
}


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
    # Fields that do not change the output (user, metadata, store, ...) are accepted;
    # those that would and are not implemented are refused by `_refuse_unsupported`.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, le=INT64 - 1, description="an int64")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions (load generators send them for fixed answer lengths)
    min_tokens: int = Field(0, ge=0, description="EOS and stop strings do not end the answer before this many tokens")
    ignore_eos: bool = Field(False, description="EOS does not end the answer (it ends at a stop string or the length)")


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def create_app(
    engine: Engine,
    *,
    api_keys: dict[str, str] | None = None,
    default_max_tokens: int = 16,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The app over `engine` (started and stopped with the app). api_keys: key -> tenant salt
    (None: no authentication, one tenant); max_body_bytes: larger request bodies get 413."""
    tokenize = Tokenizing(engine.tokenizer)
    max_prompt_bytes = prompt_byte_limit(engine.tokenizer, engine.max_context)

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            tokenize.close()
            await asyncio.to_thread(engine.stop)

    hidden = api_keys is not None  # the schema and its pages then need a key, served below
    app = FastAPI(
        title="flashmem",
        lifespan=lifespan,  # type: ignore[arg-type]
        docs_url=None if hidden else "/docs",
        redoc_url=None if hidden else "/redoc",
        openapi_url=None if hidden else "/openapi.json",
    )
    app.state.engine = engine
    app.state.max_prompt_bytes = max_prompt_bytes
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    _add_error_handlers(app)
    tenant = _tenant_of(api_keys)
    if hidden:
        _add_keyed_docs(app, tenant)
    _add_info_routes(app, engine, tenant)
    _add_generation_routes(app, engine, tenant, tokenize, max_prompt_bytes)
    app.state.default_max_tokens = default_max_tokens

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style body: ApiError, invalid requests (400), HTTP errors, crashes (500)."""

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


def _tenant_of(api_keys: dict[str, str] | None) -> Callable[[Request], str]:
    """request -> its tenant's salt (OPEN_SALT without api_keys); 401 for a missing or unknown key."""

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

    return tenant


def _check_model(engine: Engine, name: str) -> None:
    if name != engine.model_name:
        raise ApiError(
            404,
            f"model {name!r} does not exist; this server serves {engine.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _add_keyed_docs(app: FastAPI, tenant: Callable[[Request], str]) -> None:
    """/openapi.json, /docs and /redoc behind the API key."""

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        tenant(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        tenant(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="flashmem")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        tenant(request)
        return get_redoc_html(openapi_url="/openapi.json", title="flashmem")


def _add_info_routes(app: FastAPI, engine: Engine, tenant: Callable[[Request], str]) -> None:
    """/health and /metrics (open), /v1/models (keyed)."""

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


def _add_generation_routes(
    app: FastAPI, engine: Engine, tenant: Callable[[Request], str], tokenize: Tokenizing, max_prompt_bytes: int
) -> None:
    """/v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        salt = tenant(request)
        _check_model(engine, body.model)
        _refuse_unsupported(body)
        prompt = _single_prompt(body.prompt)
        if isinstance(prompt, str):
            _check_text(prompt, max_prompt_bytes, engine.max_context, "prompt")
            ids = await tokenize.run(lambda tok: list(encode(tok, prompt)))
        else:
            ids = _token_ids(engine, prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return await _generate(request, engine, body, ids, salt, chat=False, max_tokens=body.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        salt = tenant(request)
        _check_model(engine, body.model)
        _refuse_unsupported(body)
        messages = [{"role": m.role, "content": _content_text(m.content)} for m in body.messages]
        _check_text("".join(m["content"] for m in messages), max_prompt_bytes, engine.max_context, "messages")
        ids = await tokenize.run(lambda tok: chat_prompt_ids(tok, messages))
        return await _generate(
            request, engine, body, ids, salt, chat=True, max_tokens=body.max_completion_tokens or body.max_tokens
        )


# ---------------------------------------------------------------- limits
class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before anything parses it.

    The declared Content-Length is checked first; a body without one (chunked) is
    counted as it arrives. Either way the bytes are dropped as they come, up to
    DRAIN_BYTES, so memory does not grow and the client reads the 413."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        if declared is not None and declared > self.max_bytes:
            await self._refuse(receive, send, declared)
            return
        chunks: list[bytes] = []
        seen = 0
        more = True
        while more:  # read the whole (bounded) body here, so the app never sees more than the limit
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            more = bool(message.get("more_body", False))
            if seen > self.max_bytes:
                chunks.clear()
                await self._refuse(receive, send, None, seen, more)
                return
            chunks.append(chunk)
        body = b"".join(chunks)
        chunks.clear()
        delivered = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(
        self,
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
        declared: int | None,
        seen: int = 0,
        more: bool = True,
    ) -> None:
        while more and seen <= DRAIN_BYTES:  # drop what the client is still sending
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            seen += len(message.get("body", b""))
            more = bool(message.get("more_body", False))
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_bytes} bytes"
        body = json.dumps(
            {
                "error": {
                    "message": f"request body of {size}; allowed: at most {self.max_bytes} bytes "
                    "(--max-request-bytes)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if more:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def prompt_byte_limit(tokenizer: Any, max_context: int) -> int:
    """UTF-8 bytes of prompt text beyond which it cannot fit `max_context` tokens.

    Every token's text is at most `longest` bytes (its vocabulary string's UTF-8
    bytes: byte-level and SentencePiece strings spell each byte with one or more),
    so n tokens cover at most n x longest bytes of (normalized) text; a
    normalizer may shrink text (NFKC), by at most 4x per character."""
    try:
        strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in strings if isinstance(t, str)), default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary list: no text bound
        return 1 << 62
    backend = getattr(tokenizer, "backend_tokenizer", None)
    slack = 1 if backend is not None and backend.normalizer is None else 4
    return max_context * max(longest, 1) * slack


def _check_text(text: str, limit: int, max_context: int, param: str) -> None:
    """400 for text that is not valid Unicode, or too long to fit the context (before tokenizing)."""
    try:
        n = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ApiError(
            400,
            f"{param}: not valid Unicode (a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}); "
            "allowed: text without unpaired surrogates",
            param=param,
        ) from None
    if n > limit:
        raise ApiError(
            400,
            f"the {param} text has {n} bytes: more than any {max_context}-token prompt can hold "
            f"(at most {limit} bytes with this tokenizer); this model's context is {max_context} tokens",
            param=param,
            code="context_length_exceeded",
        )


def encode(tokenizer: Any, text: str, **kw: Any) -> list[int]:
    """Token ids of `text` (runs on a tokenizing thread)."""
    return list(tokenizer(text, **kw).input_ids)


class Tokenizing:
    """A few threads that tokenize, each with its own copy of the tokenizer (a fast
    tokenizer is not safe to share with the worker thread that decodes)."""

    def __init__(self, tokenizer: Any, threads: int = TOKENIZE_THREADS) -> None:
        self.tokenizer = tokenizer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flashmem-tokenize")
        self._shared = threading.Lock()  # for a tokenizer that cannot be copied

    def _own(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.tokenizer)
            except Exception:  # noqa: BLE001 - not copyable: the shared one, one thread at a time
                tok = False
            self._local.tokenizer = tok
        return tok

    def _call(self, fn: Callable[[Any], list[int]]) -> list[int]:
        tok = self._own()
        if tok is False:
            with self._shared:
                return fn(self.tokenizer)
        return fn(tok)

    async def run(self, fn: Callable[[Any], list[int]]) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _refuse_unsupported(body: BaseModel) -> None:
    """400 naming the first parameter that would change the output and is not implemented."""
    extra = body.model_extra or {}
    for name, what in UNSUPPORTED.items():
        if name not in extra:
            continue
        v = extra[name]
        if v is None or v is False or (name == "top_logprobs" and v == 0):
            continue  # the default: nothing asked (a completion's logprobs: 0 still asks for the chosen tokens')
        if name == "best_of" and v == 1 or name == "suffix" and v == "" or name in ("tools", "functions") and not v:
            continue
        if name == "response_format" and isinstance(v, dict) and v.get("type") == "text":
            continue
        if name in ("tool_choice", "function_call") and v in ("none", "auto"):
            continue
        raise ApiError(400, f"{name}: {what} is not supported by this server; leave it out", param=name)


# ---------------------------------------------------------------- prompts
def _single_prompt(prompt: str | list[int] | list[str]) -> str | list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "a list of prompts is not supported; send one prompt per request", param="prompt")
        return str(prompt[0])
    return prompt  # type: ignore[return-value]


def _token_ids(engine: Engine, prompt: list[int]) -> list[int]:
    ids = [int(x) for x in prompt]
    if len(ids) >= engine.max_context:
        return ids  # refused by its length next, without a scan
    vocab = engine.model.config.get_text_config(decoder=True).vocab_size
    if any(x < 0 or x >= vocab for x in ids):
        raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
    return ids


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The model's chat template with the assistant's turn opened; FALLBACK_CHAT_TEMPLATE
    when the tokenizer has none."""
    msgs = [{"role": m["role"], "content": _content_text(m.get("content"))} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return encode(tokenizer, text, add_special_tokens=False)
    text = "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in msgs) + "assistant:"
    return encode(tokenizer, text)


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
    request: Request, engine: Engine, body: _Common, ids: list[int], salt: str, *, chat: bool, max_tokens: int | None
) -> Response:
    _check_context(engine.max_context, body, len(ids), chat, max_tokens)
    sampling = _sampling(request, engine, body, len(ids), max_tokens)
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


def _check_context(ctx: int, body: _Common, n_prompt: int, chat: bool, max_tokens: int | None) -> None:
    """400 context_length_exceeded when the prompt (and the tokens asked for) do not fit `ctx`."""
    if n_prompt + 1 > ctx:
        raise ApiError(
            400,
            f"the prompt has {n_prompt} tokens; this model's context is {ctx} tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and n_prompt + max_tokens > ctx:
        name = "max_completion_tokens" if chat and getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise ApiError(
            400,
            f"the prompt has {n_prompt} tokens and {name} asks for {max_tokens} more; this model's context is "
            f"{ctx} tokens; allowed: {name} <= {ctx - n_prompt}",
            param=name,
            code="context_length_exceeded",
        )


def _sampling(request: Request, engine: Engine, body: _Common, n_prompt: int, max_tokens: int | None) -> Sampling:
    """The request's sampling; without max_tokens the server's default, cut at the context's end."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop: up to 4 non-empty strings", param="stop")
    if max_tokens is None:  # not asked: the default, cut at the context's end
        max_tokens = min(request.app.state.default_max_tokens, engine.max_context - n_prompt)
    if body.min_tokens > max_tokens:
        raise ApiError(
            400, f"min_tokens: {body.min_tokens}; allowed: at most the answer's max_tokens ({max_tokens})",
            param="min_tokens",
        )  # fmt: skip
    return Sampling(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=stop,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=_logit_bias(engine, body.logit_bias),
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
    )


def _logit_bias(engine: Engine, bias: dict[str, float] | None) -> dict[int, float]:
    """{"token id": bias in [-100, 100]} -> {id: bias}; 400 naming what is wrong."""
    if not bias:
        return {}
    vocab = engine.model.config.get_text_config(decoder=True).vocab_size
    if len(bias) > 300:
        raise ApiError(400, f"logit_bias: {len(bias)} entries; allowed: at most 300", param="logit_bias")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except ValueError:
            tok = -1
        if not 0 <= tok < vocab:
            raise ApiError(400, f"logit_bias: key {k!r}; allowed: token ids in [0, {vocab})", param="logit_bias")
        if not -100.0 <= v <= 100.0:  # also refuses NaN
            raise ApiError(400, f"logit_bias: {v} for token {tok}; allowed: -100 to 100", param="logit_bias")
        out[tok] = float(v)
    return out


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
