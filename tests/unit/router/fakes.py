"""Fakes for the router's unit tests: a tokenizer-only model directory and a
tiny vLLM-like OpenAI server (FastAPI) whose behaviour a test controls, both
served in-process by uvicorn on ephemeral loopback ports."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant {% endif %}")


def make_model_dir(out: str, vocab: int = 1024) -> str:
    """A WordLevel tokenizer (``w3`` .. ``w1023``, ``user``/``assistant``/``system``) with a chat template and a
    Llama-like config.json: everything the router reads (no weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    v = {"<unk>": 0, "<s>": 1, "</s>": 2}
    v.update({f"w{i}": i for i in range(3, vocab - 3)})
    v.update({"user": vocab - 3, "assistant": vocab - 2, "system": vocab - 1})
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                   "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 4096, "vocab_size": vocab,
                   "torch_dtype": "float32"}, f)
    return out


class ServerThread:
    """A uvicorn server for ``app`` on 127.0.0.1:<ephemeral> in a thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        for _ in range(2000):  # started is set once the socket serves (bounded by the join below)
            if self.server.started:
                return self
            self.thread.join(0.01)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


async def _disconnect(request: Request) -> None:
    """Returns when the client goes away (its body read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class FakeVLLM:
    """What a test controls about one fake backend."""

    name: str
    healthy: bool = True
    fail_status: int = 0
    """Answer every request with this status (a 5xx before the first byte)."""
    die_mid_stream: bool = False
    """Send one chunk, then drop the connection."""
    waiting: float = 0.0
    running: float = 0.0
    gate: asyncio.Event | None = None
    """When set, requests wait for it before their first byte (a slow prefill)."""
    gate_after_first: asyncio.Event | None = None
    """When set, a stream waits for it after its first event (a slow decode)."""
    body_bytes: int = 0
    """When set, every answer (streamed or not) carries this many bytes of padding, sent in 64 KiB
    chunks: a backend that keeps sending."""
    body_sent: list[int] = field(default_factory=list)
    """Per padded answer, the padding bytes sent when its body ended (finished, or cut by the client)."""
    trickle_s: float = 0.0
    """When set, every answer (streamed or not) sends one event or byte every ``trickle_s`` seconds and
    never ends on its own (until the client leaves, or 6,000 of them): a backend that holds a request."""
    no_done: bool = False
    """A stream ends cleanly after its first event, without ``data: [DONE]``."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    """Per request, the headers it came with."""
    cancelled: int = 0
    loop: asyncio.AbstractEventLoop | None = None
    version: Any = "0.0.0-fake"
    """What ``GET /version`` answers as ``{"version": ...}`` (vLLM's OpenAI server); None: 404."""

    def open_gate(self) -> None:
        if self.gate is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.gate.set)

    def app(self) -> FastAPI:
        app = FastAPI()
        me = self

        @app.get("/health")
        async def health() -> Response:
            me.loop = asyncio.get_running_loop()
            return Response(status_code=200 if me.healthy else 503)

        @app.get("/version")
        async def version() -> Response:
            if me.version is None:
                return Response(status_code=404)
            return JSONResponse({"version": me.version})

        @app.get("/metrics")
        async def metrics() -> Response:
            text = (f'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name="m"}} {me.waiting}\n'
                    f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name="m"}} {me.running}\n'
                    f'# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name="m"}} 0.25\n')
            return Response(text, media_type="text/plain")

        async def answer(request: Request, kind: str) -> Response:
            me.loop = asyncio.get_running_loop()
            body = await request.json()
            me.requests.append(body)
            me.headers.append(dict(request.headers))
            if me.fail_status:
                return JSONResponse({"error": {"message": "boom"}}, status_code=me.fail_status)
            text = f"{me.name}-answer"
            if me.trickle_s:
                return StreamingResponse(me.trickle(kind, bool(body.get("stream"))),
                                         media_type="text/event-stream" if body.get("stream") else
                                         "application/json")
            if me.body_bytes:
                return StreamingResponse(me.padded(kind, text, bool(body.get("stream"))),
                                         media_type="text/event-stream" if body.get("stream") else
                                         "application/json")
            if body.get("stream"):
                async def gen() -> AsyncIterator[bytes]:
                    try:
                        if me.gate is not None:
                            await me.gate.wait()
                        yield f'data: {json.dumps({"object": kind, "choices": [{"text": text}]})}\n\n'.encode()
                        if me.gate_after_first is not None:
                            await me.gate_after_first.wait()
                        if me.die_mid_stream:
                            raise RuntimeError("backend died")
                        if me.no_done:
                            return
                        yield b'data: {"choices": [{"text": "!"}]}\n\n'
                        yield b"data: [DONE]\n\n"
                    except asyncio.CancelledError:
                        me.cancelled += 1
                        raise
                return StreamingResponse(gen(), media_type="text/event-stream")
            if me.gate is not None:  # as vLLM does, a client that leaves aborts the request
                opened = asyncio.ensure_future(me.gate.wait())
                gone = asyncio.ensure_future(_disconnect(request))
                try:
                    await asyncio.wait({opened, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    opened.cancel()
                    gone.cancel()
                if not opened.done() or opened.cancelled():
                    me.cancelled += 1
                    return Response(status_code=499)
            return JSONResponse({"object": kind, "model": body.get("model"), "choices": [{"text": text}]})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await answer(request, "text_completion")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await answer(request, "chat.completion")

        return app

    async def trickle(self, kind: str, stream: bool) -> AsyncIterator[bytes]:
        """One SSE event (or one byte of a JSON answer) every ``trickle_s`` seconds."""
        try:
            yield f'data: {json.dumps({"object": kind, "choices": [{"text": "t"}]})}\n\n'.encode() if stream \
                else f'{{"object": "{kind}", "choices": [{{"text": "'.encode()
            for _ in range(6000):
                await asyncio.sleep(self.trickle_s)
                yield b'data: {"choices": [{"text": "t"}]}\n\n' if stream else b"t"
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def padded(self, kind: str, text: str, stream: bool) -> AsyncIterator[bytes]:
        """An answer with ``body_bytes`` of padding: SSE events, or one JSON
        object whose ``pad`` field is sent in chunks."""
        chunk = 64 << 10
        sent = 0
        try:
            if stream:
                yield f'data: {json.dumps({"object": kind, "choices": [{"text": text}]})}\n\n'.encode()
                while sent < self.body_bytes:
                    yield b'data: {"pad": "' + b"x" * (chunk - 16) + b'"}\n\n'
                    sent += chunk
                    await asyncio.sleep(0)
                yield b"data: [DONE]\n\n"
            else:
                yield f'{{"object": "{kind}", "choices": [{{"text": "{text}"}}], "pad": "'.encode()
                while sent < self.body_bytes:
                    yield b"x" * chunk
                    sent += chunk
                    await asyncio.sleep(0)  # uvicorn drops sends to a gone client: let its cancel land
                yield b'"}'
        finally:
            self.body_sent.append(sent)
