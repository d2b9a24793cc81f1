"""The OpenAI-compatible HTTP app over an `Engine`: /v1/chat/completions (streaming or not), /v1/completions
(with echo and logprobs, as lm-eval's local-completions model asks), /v1/models, and vLLM's tokenizer routes
(/tokenizer_info, /tokenize, /detokenize), through which lm-eval's local-completions model tokenizes as the run
does (its `tokenizer_backend=auto` finds them) and sends token ids. They name no end-of-text or BOS text (a
special token is never parsed from text), so lm-eval is given the prefix id of an empty context:

    lm_eval --model local-completions --model_args base_url=http://127.0.0.1:8000/v1/completions,model=NAME,\
        custom_prefix_token_id=ID,max_length=CONTEXT --tasks TASK

    app = server.make_app(engine, name="sft", limits=server.Limits(max_prompt_tokens=1024, max_tokens=256))

A malformed request, or one past the limits, is answered 400 with an OpenAI error object naming the field
({"error": {"message", "type": "invalid_request_error", "param"}}); the server goes on serving. Requests
run concurrently; the engine decodes those of the same prompt length and sampling as one batch.
"""

import dataclasses
import json
import time
import uuid
from typing import Literal

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from transformer.inference.engine import Engine

MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 0  # 0: the model's context less one
    max_tokens: int = 512       # new tokens of one answer at most


class RequestError(Exception):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int = 0


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


def _error(status: int, param: str | None, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)


def _stops(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else [s for s in stop or [] if s]


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """text up to its first stop string, and whether there was one."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def make_app(engine: Engine, name: str, limits: Limits = Limits()) -> fastapi.FastAPI:
    app = fastapi.FastAPI(title=f"transformer: {name}")
    context = engine.context
    max_prompt = min(limits.max_prompt_tokens or context - 1, context - 1)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        return _error(400, param, f"{param}: {first['msg']}")

    @app.exception_handler(RequestError)
    async def refused(request, exc: RequestError):
        return _error(400, exc.param, f"{exc.param}: {exc}")

    def budget(ids: list[int], asked: int | None, param: str, default: int) -> int:
        if len(ids) > max_prompt:
            raise RequestError(param, f"{len(ids)} tokens, more than this server's {max_prompt}")
        if asked is not None and asked > limits.max_tokens:
            raise RequestError("max_tokens", f"{asked} is more than this server's {limits.max_tokens}")
        return min(default if asked is None else asked, limits.max_tokens, context - len(ids))

    def pieces(ids, n, body):
        """(text so far, the new ids (the stop id that ends them included), finish reason) after each new
        token, the text cut at a stop string."""
        stops, new = _stops(body.stop), []
        for token in engine.generate(ids, n, body.temperature, 0, body.top_p, body.seed) if n else ():
            new.append(token)
            text, stopped = _cut(decode(new), stops)
            yield text, new, ("stop" if stopped else None)
            if stopped:
                return
        ended = bool(new) and new[-1] in engine.stop_ids
        yield _cut(decode(new), stops)[0], new, "stop" if ended or len(new) < n else "length"

    def decode(ids):
        ids = [i for i in ids if i not in engine.stop_ids]
        return engine.chat.decode(ids) if engine.chat else engine.tokenizer.decode(ids)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "transformer"}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"eos_token": None, "bos_token": None, "pad_token": None, "model_max_length": context,
                "stop_token_ids": list(engine.stop_ids)}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ids = engine.text_ids(body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ids = _prompt_ids(engine, body.tokens, "tokens")
        return {"prompt": engine.chat.decode(ids) if engine.chat else engine.tokenizer.decode(ids)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        if engine.chat is None:
            raise RequestError("model", f"{name} has no chat template: use /v1/completions, or fine-tune it "
                                        "with the sft task")
        try:
            ids = engine.chat.prompt([m.model_dump() for m in body.messages]).tolist()
        except ValueError as e:
            raise RequestError("messages", str(e)) from None
        n = budget(ids, body.max_completion_tokens or body.max_tokens, "messages", limits.max_tokens)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        if body.stream:
            return StreamingResponse(_chat_stream(head, pieces(ids, n, body)), media_type="text/event-stream")
        text, new, finish = await run_in_threadpool(_last, pieces(ids, n, body))
        return {**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": _usage(ids, new)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        if not prompts:
            raise RequestError("prompt", "give a text or token ids")
        if body.stream and (len(prompts) > 1 or body.logprobs is not None or body.echo):
            raise RequestError("stream", "streams one prompt without echo or logprobs")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        asked = [_prompt_ids(engine, p) for p in prompts]
        for ids in asked:
            if not ids:
                raise RequestError("prompt", "encodes to no tokens")
        ns = [budget(ids, body.max_tokens, "prompt", 16) for ids in asked]
        if body.stream:
            return StreamingResponse(_completion_stream(head, pieces(asked[0], ns[0], body)),
                                     media_type="text/event-stream")
        choices, used = [], [0, 0]
        for index, (ids, n) in enumerate(zip(asked, ns)):
            text, new, finish = await run_in_threadpool(_last, pieces(ids, n, body))
            choice = {"index": index, "text": (decode(ids) if body.echo else "") + text, "finish_reason": finish,
                      "logprobs": None}
            if body.logprobs is not None:
                choice["logprobs"] = await run_in_threadpool(_logprobs, engine, ids, new, body.logprobs, body.echo)
            choices.append(choice)
            used = [used[0] + len(ids), used[1] + len(new)]
        return {**head, "object": "text_completion", "choices": choices,
                "usage": {"prompt_tokens": used[0], "completion_tokens": used[1], "total_tokens": sum(used)}}

    return app


def _last(iterator):
    *_, last = iterator
    return last


def _usage(ids, new) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}


def _prompt_ids(engine: Engine, prompt, param: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        return engine.text_ids(prompt)
    bad = [i for i in prompt if not 0 <= i < engine.model.vocab_size]
    if bad:
        raise RequestError(param, f"token id {bad[0]} is outside the model's {engine.model.vocab_size} ids")
    return list(prompt)


def _logprobs(engine: Engine, ids: list[int], new: list[int], top: int, echo: bool) -> dict:
    """OpenAI's legacy logprobs object: the prompt's tokens (with echo; the first has none) and the new ones."""
    every = ids + new
    chosen, tops = engine.score(every, top) if len(every) > 1 else ([], [])
    token_logprobs = [None, *chosen]
    top_logprobs = [None, *({engine.token_text(t): v for t, v in d.items()} for d in tops)] if top else [None] * len(
        every)
    start = 0 if echo else len(ids)
    texts = [engine.token_text(t) for t in every]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts[start:], "token_logprobs": token_logprobs[start:], "top_logprobs": top_logprobs[start:],
            "text_offset": offsets[start:]}


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _chat_stream(head: dict, pieces):
    shown = ""
    yield _sse({**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    async for text, _, finish in iterate_in_threadpool(pieces):
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            yield _sse({**head, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": text[len(shown):]}, "finish_reason": None}]})
            shown = text
        if finish:
            yield _sse({**head, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    yield "data: [DONE]\n\n"


async def _completion_stream(head: dict, pieces):
    shown = ""
    async for text, _, finish in iterate_in_threadpool(pieces):
        if (len(text) > len(shown) and not text.endswith("\ufffd")) or finish:
            yield _sse({**head, "object": "text_completion",
                        "choices": [{"index": 0, "text": text[len(shown):], "finish_reason": finish,
                                     "logprobs": None}]})
            shown = text
    yield "data: [DONE]\n\n"

