"""The OpenAI-compatible HTTP app over an `Engine`: /v1/chat/completions (streaming or not), /v1/completions
(with echo and logprobs, as lm-eval's local-completions model asks), /v1/models, and vLLM's tokenizer routes
(/tokenizer_info, /tokenize, /detokenize), through which lm-eval's local-completions model tokenizes as the run
does (its `tokenizer_backend=auto` finds them) and sends token ids. They name no end-of-text or BOS text (a
special token is never parsed from text), so lm-eval is given the prefix id of an empty context:

    lm_eval --model local-completions --model_args base_url=http://127.0.0.1:8000/v1/completions,model=NAME,\
        custom_prefix_token_id=ID,max_length=CONTEXT --tasks TASK

    app = server.make_app(engine, "sft", server.Limits(max_prompt_tokens=1024, max_tokens=256), api_key="KEY")

The routes are module-level functions over the `Served` record in `app.state` (as Levanter's
inference/openai.py). Before any route, a guard answers a request without the API key 401 and a body past
the limits 400 (by its bytes, unparsed); every body is read as JSON. Tokenizing runs in worker threads,
never on the event loop nor the engine's thread; a request's choices decode at most IN_FLIGHT at a time, so
a long one does not starve the others. A bad request is answered 400 with an OpenAI error object naming the
field ({"error": {"message", "type", "param"}}) and the server goes on; a client gone mid-stream closes its
generation (its engine row freed).
"""

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from typing import Annotated

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from transformer.inference import protocol, sampling, scoring
from transformer.inference.engine import Engine
from transformer.inference.protocol import ChatRequest, CompletionRequest, Message, Sampling

BYTES_PER_TOKEN = 32       # body bytes allowed per prompt token (any script, JSON-escaped)
BODY_SLACK = 1 << 16       # and for the rest of a request
IN_FLIGHT = 4              # choices of one request decoded at once
JSON = b"application/json"  # what every body is read as, whatever its Content-Type


@dataclasses.dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 0  # 0: the model's context less one
    max_tokens: int = 512       # new tokens of one answer at most
    max_choices: int = 16       # prompts times n of one request at most


class RequestError(Exception):
    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Served:
    """What the routes read from `app.state.served`: the engine, the model's name in the API, the limits
    resolved against its context, and the API key ('' for none)."""
    engine: Engine
    name: str
    limits: Limits
    api_key: str = ""

    @property
    def max_prompt(self) -> int:
        return min(self.limits.max_prompt_tokens or self.engine.context - 1, self.engine.context - 1)

    @property
    def body_bytes(self) -> int:
        return BODY_SLACK + BYTES_PER_TOKEN * self.max_prompt * self.limits.max_choices

    def choices(self, prompts: int, n: int) -> None:
        """Refuses a request of more than `max_choices` prompts times n."""
        if prompts * n > self.limits.max_choices:
            asked = f"n={n}" if prompts == 1 else f"{prompts} prompts" + (f" times n={n}" if n > 1 else "")
            raise RequestError("n" if prompts == 1 else "prompt", f"{asked} is more than this server's "
                               f"{self.limits.max_choices} choices per request")

    def budget(self, ids: list[int], asked: int | None, param: str, default: int) -> int:
        """The new tokens one choice may write: `asked` (or `default`), checked against the limits."""
        context = self.engine.context
        if len(ids) > self.max_prompt:
            raise RequestError(param, f"{len(ids)} tokens, more than this server's {self.max_prompt}")
        if asked is not None and asked > self.limits.max_tokens:
            raise RequestError("max_tokens", f"{asked} is more than this server's {self.limits.max_tokens}")
        if asked is not None and len(ids) + asked > context:
            raise RequestError("max_tokens", f"{len(ids)} prompt tokens and {asked} new ones are more than the "
                               f"model's {context}-token context: ask for at most {context - len(ids)}")
        return min(default if asked is None else asked, self.limits.max_tokens, context - len(ids))


def make_app(engine: Engine, name: str, limits: Limits = Limits(), api_key: str = "") -> fastapi.FastAPI:
    """The app serving `engine` as model `name`; requests without `Authorization: Bearer API_KEY` get 401
    where `api_key` is given."""
    app = fastapi.FastAPI(title=f"transformer: {name}")
    app.state.served = Served(engine, name, limits, api_key)
    app.include_router(routes)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(RequestError, _refused)
    app.add_middleware(Guard, served=app.state.served)
    return app


def _error(status: int, param: str | None, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": code}}, status_code=status)


async def _invalid(request, exc: RequestValidationError):
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return _error(400, None, f"invalid JSON at character {first['loc'][-1]}: {first['ctx']['error']}")
    param = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
    return _error(400, param, f"{param}: {first['msg'].removeprefix('Value error, ')}")


async def _refused(request, exc: RequestError):
    return _error(400, exc.param, f"{exc.param}: {exc}" if exc.param else str(exc))


class Guard:
    """Plain ASGI middleware before every route: without the API key a request is answered 401, and a body
    longer than `served.body_bytes` 400 (read and dropped, never parsed); a body within is handed on whole."""

    def __init__(self, app, served: Served):
        self.app, self.served = app, served

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.served.api_key and not hmac.compare_digest(
                headers.get(b"authorization", b""), f"Bearer {self.served.api_key}".encode()):
            return await _error(401, None, "give this server's API key: Authorization: Bearer KEY",
                                "invalid_api_key")(scope, receive, send)
        limit, chunks, size, more = self.served.body_bytes, [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            more = message.get("more_body", False)
            size += len(message.get("body", b""))
            if size <= limit:
                chunks.append(message.get("body", b""))
        if size > limit:
            return await _error(400, None, f"the request body is {size} bytes, more than this server's {limit} (for "
                                f"{self.served.limits.max_choices} prompts of {self.served.max_prompt} tokens)")(
                scope, receive, send)
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return body.pop() if body else await receive()
        json_body = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + [(b"content-type", JSON)]
        await self.app({**scope, "headers": json_body}, replay, send)  # curl -d's body too is JSON


def _served(request: fastapi.Request) -> Served:
    return request.app.state.served


Serving = Annotated[Served, fastapi.Depends(_served)]
routes = fastapi.APIRouter()


@routes.get("/v1/models")
async def models(served: Serving):
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                        "owned_by": "transformer"}]}


@routes.get("/tokenizer_info")
async def tokenizer_info(served: Serving):
    return {"eos_token": None, "bos_token": None, "pad_token": None, "model_max_length": served.engine.context,
            "stop_token_ids": list(served.engine.stop_ids)}


@routes.post("/tokenize")
async def tokenize(body: protocol.TokenizeRequest, served: Serving):
    ids = await run_in_threadpool(served.engine.text_ids, body.prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": served.engine.context}


@routes.post("/detokenize")
async def detokenize(body: protocol.DetokenizeRequest, served: Serving):
    ids = _prompt_ids(served.engine, body.tokens, "tokens")
    return {"prompt": await run_in_threadpool(served.engine.text, ids, False)}


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, served: Serving):
    engine = served.engine
    if engine.chat is None:
        raise RequestError("model", f"{served.name} has no chat template: use /v1/completions, or fine-tune it "
                                    "with the sft task")
    served.choices(1, body.n)
    if body.stream and body.n > 1:
        raise RequestError("stream", "streams one choice (n=1)")
    ids = await run_in_threadpool(_chat_ids, engine, body.messages)
    n = served.budget(ids, body.max_completion_tokens or body.max_tokens, "messages", served.limits.max_tokens)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served.name}
    if body.stream:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        chunk = (lambda text, finish: {**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]})
        return StreamingResponse(_events(_pieces(engine, ids, n, body, 0), chunk, {
            **head, "object": "chat.completion.chunk", "choices": [first]}), media_type="text/event-stream")

    def answer(j):
        text, new, finish = _last(_pieces(engine, ids, n, body, j))
        return {"index": j, "message": {"role": "assistant", "content": text}, "finish_reason": finish}, len(new)
    choices = await _gathered(answer, body.n)
    written = sum(new for _, new in choices)
    return {**head, "object": "chat.completion", "choices": [c for c, _ in choices], "usage": {
        "prompt_tokens": len(ids), "completion_tokens": written, "total_tokens": len(ids) + written}}


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, served: Serving):
    engine = served.engine
    prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
        body.prompt[0], int) else [body.prompt]
    if not prompts or not body.prompt:
        raise RequestError("prompt", "give a text or token ids")
    served.choices(len(prompts), body.n)
    if body.stream and (len(prompts) > 1 or body.n > 1 or body.logprobs is not None or body.echo):
        raise RequestError("stream", "streams one prompt and one choice without echo or logprobs")
    asked = await run_in_threadpool(lambda: [_prompt_ids(engine, p) for p in prompts])
    if not all(asked):
        raise RequestError("prompt", "encodes to no tokens")
    ns = [served.budget(ids, body.max_tokens, "prompt", 16) for ids in asked]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served.name}
    if body.stream:
        chunk = (lambda text, finish: {**head, "object": "text_completion", "choices": [
            {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]})
        return StreamingResponse(_events(_pieces(engine, asked[0], ns[0], body, 0), chunk),
                                 media_type="text/event-stream")

    def answer(index):
        ids, n = asked[index // body.n], ns[index // body.n]
        text, new, finish = _last(_pieces(engine, ids, n, body, index % body.n))
        choice = {"index": index, "text": (engine.text(ids) if body.echo else "") + text,
                  "finish_reason": finish, "logprobs": None}
        if body.logprobs is not None:
            choice["logprobs"] = _logprobs(engine, ids, new, body.logprobs, body.echo)
        return choice, (len(ids), len(new))
    choices = await _gathered(answer, len(prompts) * body.n)
    used = [sum(used[0] for _, used in choices[::body.n]), sum(used[1] for _, used in choices)]
    return {**head, "object": "text_completion", "choices": [c for c, _ in choices],
            "usage": {"prompt_tokens": used[0], "completion_tokens": used[1], "total_tokens": sum(used)}}


async def _gathered(answer, count: int) -> list:
    """[answer(i) for i < count], each in a worker thread, at most IN_FLIGHT at once."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(i):
        async with gate:
            return await run_in_threadpool(answer, i)
    return await asyncio.gather(*(one(i) for i in range(count)))


def _chat_ids(engine: Engine, messages: list[Message]) -> list[int]:
    try:
        return engine.chat.prompt([m.model_dump() for m in messages]).tolist()
    except ValueError as e:
        raise RequestError("messages", str(e)) from None


def _prompt_ids(engine: Engine, prompt, param: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        return engine.text_ids(prompt)
    bad = [i for i in prompt if not 0 <= i < engine.model.vocab_size]
    if bad:
        raise RequestError(param, f"token id {bad[0]} is outside the model's {engine.model.vocab_size} ids")
    return list(prompt)


def _pieces(engine: Engine, ids: list[int], n: int, body: Sampling, choice: int):
    """(text so far, the new ids (the stop id that ends them included), finish reason) after each new token of
    choice `choice` (seeded by the request's seed XOR choice), the text cut at a stop string."""
    stops, new = [s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or []) if s], []
    asked = n and sampling.Sampling(body.temperature, 0, body.top_p, body.seed ^ choice, n, engine.stop_ids)
    for token in engine.stream(ids, asked) if n else ():
        new.append(token)
        text, stopped = sampling.cut_at_stops(engine.text(new), stops)
        yield text, new, ("stop" if stopped else None)
        if stopped:
            return
    ended = bool(new) and new[-1] in engine.stop_ids
    yield sampling.cut_at_stops(engine.text(new), stops)[0], new, "stop" if ended or len(new) < n else "length"


def _last(iterator):
    *_, last = iterator
    return last


def _logprobs(engine: Engine, ids: list[int], new: list[int], top: int, echo: bool) -> dict:
    """OpenAI's legacy logprobs object: the prompt's tokens (with echo; the first has none) and the new ones."""
    every = ids + new
    score = lambda: scoring.token_logprobs(engine.model, engine.params, every, top)
    chosen, tops = engine.call(score) if len(every) > 1 else ([], [])
    token_logprobs = [None, *chosen]
    top_logprobs = [None, *({protocol.token_key(engine, t): v for t, v in d.items()} for d in tops)] if top else [
        None] * len(every)
    start = 0 if echo else len(ids)
    offsets = [0]
    for t in every[:-1]:
        offsets.append(offsets[-1] + len(engine.token_text(t)))
    return {"tokens": [protocol.token_key(engine, t) for t in every[start:]], "token_logprobs": token_logprobs[start:],
            "top_logprobs": top_logprobs[start:], "text_offset": offsets[start:]}


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(pieces, chunk, first: dict | None = None):
    """Server-sent events of a stream: `first`, then `chunk(new text, finish reason)` as the text grows (never
    ending inside a character) and at its end, then [DONE]. A client gone mid-stream closes `pieces`."""
    try:
        if first is not None:
            yield _sse(first)
        shown = ""
        async for text, _, finish in iterate_in_threadpool(pieces):
            grew = len(text) > len(shown) and (finish is not None or not text.endswith("\ufffd"))
            if grew or finish:
                yield _sse(chunk(text[len(shown):] if grew else "", finish))
                shown = text if grew else shown
        yield "data: [DONE]\n\n"
    finally:
        pieces.close()
