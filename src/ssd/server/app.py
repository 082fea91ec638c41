"""The OpenAI-compatible HTTP app (FastAPI) over an AsyncEngine, and helpers to run it with uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
GET /health (never needs the API key), GET /metrics (Prometheus text format).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd.sampling_params import SamplingParams
from ssd.server.async_engine import AsyncEngine, EngineError, EngineRequest, RequestGroup
from ssd.server.metrics import ServerMetrics
from ssd.server.protocol import (
    SEED_LIMIT,
    APIError,
    ChatRequest,
    Choice,
    CompletionRequest,
    bad_request,
    chat_messages,
    check_chat,
    check_completion,
    chunk_body,
    completion_body,
    logprobs_body,
    parse,
    wanted_logprobs,
    ssd_extension,
    sse,
    usage,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
MAX_ENGINE_REQUESTS = 256          # prompts x n of one API call


def served_model_name(model: str) -> str:
    """The name clients use in `model`: a folder's or file's name, else the name/hub id as given."""
    p = Path(model)
    if p.exists():
        return p.stem if p.is_file() else p.name
    return model


class OpenAIServer:
    """Request handling shared by the two generation routes."""

    def __init__(self, llm, engine: AsyncEngine, name: str, max_body_bytes: int):
        self.llm = llm
        self.engine = engine
        self.metrics = engine.metrics
        self.name = name
        self.aliases = {name, str(llm.config.model)}
        self.max_body_bytes = max_body_bytes
        self.mode = llm.config.mode
        self.k = llm.config.k

    # ---- request -> engine requests -------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id])

    async def read_json(self, request: Request):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"the request body is larger than {self.max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise APIError(413, f"the request body is larger than {self.max_body_bytes} bytes")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise bad_request(f"the request body is not valid JSON: {str(e)[:200]}") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.aliases:
            raise APIError(404, f"the model '{model[:100]}' does not exist: this server serves '{self.name}'",
                           param="model", code="model_not_found")

    def prompts(self, req, chat: bool) -> list[tuple[list[int], str | None]]:
        if chat:
            try:
                return [(self.llm.encode_chat(chat_messages(req)), None)]
            except Exception as e:  # noqa: BLE001 - template errors are the request's fault
                raise bad_request(f"cannot apply the chat template to these messages: {e}", "messages") from None
        p = req.prompt
        if p and isinstance(p, list) and isinstance(p[0], int):
            return [(list(p), None)]
        try:
            if isinstance(p, str):
                return [(self.llm.encode(p), p)]
            return [(self.llm.encode(x), x) if isinstance(x, str) else (list(x), None) for x in p]
        except Exception as e:  # noqa: BLE001 - e.g. lone UTF-16 surrogates the tokenizer cannot take
            raise bad_request(f"cannot tokenize the prompt: {type(e).__name__}: {str(e)[:200]}", "prompt") from None

    def engine_requests(self, req, chat: bool, prompts) -> list[EngineRequest]:
        if len(prompts) * req.n > MAX_ENGINE_REQUESTS:
            raise bad_request(f"prompts x n must be at most {MAX_ENGINE_REQUESTS}, got {len(prompts) * req.n}", "n")
        max_tokens = req.max_tokens
        if chat and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        ctx = self.llm.max_model_len
        out = []
        for ids, text in prompts:
            L = len(ids)
            if L >= ctx:
                raise bad_request(f"this model's maximum context length is {ctx} tokens, but the prompt has {L} "
                                  "tokens: shorten the prompt", "messages" if chat else "prompt",
                                  "context_length_exceeded")
            mt = ctx - L if max_tokens is None else max_tokens
            if L + mt > ctx:
                raise bad_request(f"this model's maximum context length is {ctx} tokens, but {L + mt} were "
                                  f"requested ({L} in the prompt, {mt} for the completion): lower max_tokens or "
                                  "shorten the prompt", "max_tokens", "context_length_exceeded")
            for i in range(req.n):
                try:
                    params = SamplingParams(
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p,
                        top_k=req.top_k or 0,
                        seed=None if req.seed is None else (req.seed + i) % SEED_LIMIT,
                        max_tokens=mt, stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                        ignore_eos=req.ignore_eos, logprobs=wanted_logprobs(req, chat),
                        speculate=True if req.speculate is None else req.speculate, max_draft=req.max_draft)
                except ValueError as e:
                    field = str(e).split(": ", 1)[-1].split(" ")[0]
                    raise bad_request(str(e), field if field in type(req).model_fields else None) from None
                out.append(EngineRequest(ids, params, text))
        return out

    # ---- the routes -------------------------------------------------------------------------------
    async def handle(self, request: Request, chat: bool) -> Response:
        try:
            body = await self.read_json(request)
            req = parse(ChatRequest if chat else CompletionRequest, body)
            (check_chat if chat else check_completion)(req)
            self.check_model(req.model)
            prompts = self.prompts(req, chat)
            engine_reqs = self.engine_requests(req, chat, prompts)
            try:
                group = await self.engine.submit(engine_reqs)
            except EngineError:
                raise
            except ValueError as e:
                raise bad_request(str(e)) from None
        except APIError as e:
            self.metrics.request_done("rejected" if e.status < 500 else "error")
            raise
        except EngineError as e:
            self.metrics.request_done("error")
            raise APIError(503, str(e), type="server_error") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        echo = None
        if not chat and req.echo:
            echo = [text if text is not None else self.llm.tokenizer.decode(ids) for ids, text in prompts
                    for _ in range(req.n)]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = self.stream(group, rid, chat, prompt_tokens, echo, include_usage)
            return SSEResponse(gen, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.collect(request, group, rid, chat, prompt_tokens, echo)

    async def collect(self, request: Request, group: RequestGroup, rid: str, chat: bool, prompt_tokens: int,
                      echo: list[str] | None) -> Response:
        choices = [Choice(i, echo[i] if echo else "", text_offset=len(echo[i]) if echo else 0)
                   for i in range(len(group.request_ids))]

        async def run() -> None:
            async for d in group.deltas():
                _apply(choices[d.index], d)

        task = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():         # the client went away: free its blocks now
                task.cancel()
                self.metrics.request_done("aborted")
                return Response(status_code=499)
            try:
                task.result()
            except EngineError as e:
                self.metrics.request_done("error")
                raise APIError(500, str(e), type="server_error") from None
        finally:
            watch.cancel()
            group.close()
        self.metrics.request_done("success")
        return JSONResponse(completion_body(rid, self.name, choices, prompt_tokens,
                                            ssd_extension(self.mode, self.k, choices), chat, self.token_text))

    async def stream(self, group: RequestGroup, rid: str, chat: bool, prompt_tokens: int, echo: list[str] | None,
                     include_usage: bool):
        n = len(group.request_ids)
        created = int(time.time())
        choices = [Choice(i) for i in range(n)]
        offsets = [len(echo[i]) if echo else 0 for i in range(n)]   # completions: text_offset of the next token
        status = "aborted"
        try:
            for i in range(n):
                if chat:
                    yield sse(chunk_body(rid, self.name, created, chat, i, role=True))
                elif echo:
                    yield sse(chunk_body(rid, self.name, created, chat, i, text=echo[i]))
            async for d in group.deltas():
                c = choices[d.index]
                _apply(c, d)
                if not (d.text or d.finished or d.logprobs):
                    continue
                lp = logprobs_body(d.logprobs, self.token_text, chat, offsets[d.index]) if d.logprobs else None
                if lp is not None and not chat:
                    offsets[d.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                body = chunk_body(rid, self.name, created, chat, d.index, d.text,
                                  d.finish_reason if d.finished else None, logprobs=lp)
                if group.finished:
                    body["ssd"] = ssd_extension(self.mode, self.k, choices)
                yield sse(body)
            if include_usage:
                body = chunk_body(rid, self.name, created, chat, None)
                body["usage"] = usage(prompt_tokens, sum(c.num_generated_tokens for c in choices))
                body["ssd"] = ssd_extension(self.mode, self.k, choices)
                yield sse(body)
            yield sse("[DONE]")
            status = "success"
        except EngineError as e:
            status = "error"
            yield sse(APIError(500, str(e), type="server_error").body())
        finally:
            group.close()
            self.metrics.request_done(status)


def _apply(c: Choice, d) -> None:
    c.text += d.text
    if d.logprobs is not None:
        c.logprobs = (c.logprobs or []) + list(d.logprobs)
    if d.finished:
        c.finish_reason = d.finish_reason
        c.num_prompt_tokens = d.num_prompt_tokens
        c.num_generated_tokens = d.num_generated_tokens
        c.spec = d.spec
        c.ssd_hits = d.ssd_hits
        c.degraded_from = d.degraded_from


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator (which aborts the engine requests), also
    when the ASGI server reports a disconnect by raising instead of cancelling."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class APIKeyMiddleware:
    """Bearer-token check on every HTTP route except /health (pure ASGI: streaming passes through)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                msg = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "invalid API key"
                resp = JSONResponse(APIError(401, msg, code="invalid_api_key").body(), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(llm, served_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app serving `llm` (its engine is owned by the app's background thread while it runs:
    do not call llm.generate meanwhile)."""
    name = served_name or served_model_name(str(llm.config.model))
    metrics = ServerMetrics(llm.config.mode, name, llm.config.k)
    engine = AsyncEngine(llm, metrics)
    server = OpenAIServer(llm, engine, name, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="ssd OpenAI-compatible server", lifespan=lifespan)
    app.state.server = server
    app.state.engine = engine
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(bad_request(f"invalid request: {exc.errors()[:1]}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        err = APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "ssd", "max_model_len": llm.max_model_len,
                                            "mode": llm.config.mode}]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    return app


# ---- running it -----------------------------------------------------------------------------------
def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=log_level in ("info", "debug"))
    return uvicorn.Server(config)


class BackgroundServer:
    """Run an app with uvicorn in a thread on a free loopback port (tests, notebooks):

        with BackgroundServer(build_app(llm)) as srv:
            OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.server = make_server(app, host, port, log_level)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="ssd-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
