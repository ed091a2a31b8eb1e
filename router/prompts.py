"""From an OpenAI request body to the tokens and block keys a backend will see.

The router hashes the same tokens the vLLM connector hashes: a completion's
prompt through the model's Hugging Face tokenizer (``add_special_tokens`` as
the request says, default true, as vLLM does); a chat through the model's
chat template with ``tokenize=True`` (``add_generation_prompt`` default
true, text content parts joined with newlines: vLLM's "string" content
format). The namespace comes from the one shared derivation,
:func:`kvstore.identity.engine_namespace`, called with the backends' block
size, KV dtype and TP size; nothing is copied by hand. It names the vLLM
version (an upgrade may change the KV): each backend's, which the router
learns from its ``GET /version`` (``router.backends``), unless the model
pins ``engine_version``; a backend of unknown version has no namespace and
is predicted a miss (:func:`keys_at`).

Keys cover the blocks the connector could load: at most
``(len(prompt) - 1) // block_size`` (the last prompt token is always
computed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import KVDtype, Namespace, block_keys
from router.config import ModelSpec

log = logging.getLogger("kvstore.router")

__all__ = ["Endpoint", "ModelEntry", "NamespaceFn", "PromptKeys", "keys_at", "load_model", "request_tokens"]

NamespaceFn = Callable[[ModelSpec], Namespace]
"""Derives a model's KV namespace (tests may pass their own)."""


class Endpoint(Enum):
    """The OpenAI endpoint a request came to."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class BadRequest(InvalidArgument):
    """A request the router refuses with HTTP 400 (its message goes to the client)."""


def shared_namespace(spec: ModelSpec) -> Namespace:
    """The connector's namespace for ``spec``: :func:`kvstore.identity.engine_namespace`
    with the backends' block size, KV dtype, TP size, platform, layout and vLLM version."""
    from kvstore.identity import engine_namespace, vllm_layout_tag

    return engine_namespace(spec.path, block_size=spec.block_size, kv_dtype=KVDtype.parse(spec.kv_dtype),
                            tp_size=spec.tp_size, tenant=spec.namespace_tenant,
                            weights_digest=spec.weights_digest or None, hf_overrides=spec.hf_overrides,
                            layout_tag=vllm_layout_tag(spec.device, spec.kv_cache_layout, spec.layout_tag, spec.tp_size,
                                                       spec.engine_version),
                            compute_dtype=spec.dtype or None, model_id=spec.model_id or None,
                            disable_sliding_window=spec.disable_sliding_window,
                            quantization=spec.quantization or None, config_format=spec.config_format)


@dataclass(slots=True)
class ModelEntry:
    """A served model: its tokenizer and namespace."""

    spec: ModelSpec
    tokenizer: Any
    """A Hugging Face tokenizer (``transformers.AutoTokenizer``)."""
    namespace: Namespace
    """The namespace at ``spec.engine_version`` (without a pinned version, one no vLLM connector uses:
    backends are keyed at their own version, :meth:`namespace_at`)."""
    max_model_len: int
    block_bytes: int
    """Bytes of one KV block across all layers (per TP rank)."""
    namespace_fn: NamespaceFn = shared_namespace
    versions: dict[str, Namespace] = field(default_factory=dict)
    """Namespaces by vLLM version, derived on first use."""

    def namespace_at(self, version: str) -> Namespace | None:
        """The namespace of a backend running vLLM ``version``: the pinned
        ``spec.engine_version`` when set; None when neither is known (or the
        derivation failed: a miss, never a wrong hit)."""
        version = self.spec.engine_version or version
        if not version:
            return None
        if version == self.spec.engine_version:
            return self.namespace
        ns = self.versions.get(version)
        if ns is None:
            # the weights digest is the start-up one: not hashed again (on the event loop) per version
            spec = dataclasses.replace(self.spec, engine_version=version,
                                       weights_digest=self.spec.weights_digest or self.namespace.weights_digest)
            try:
                ns = self.namespace_fn(spec)
            except Exception as e:  # noqa: BLE001 - the backend is then predicted a miss
                log.warning("model %s: no namespace for vLLM %s: %s", self.spec.name, version, e)
                return None
            self.versions[version] = ns
        return ns


@dataclass(slots=True, frozen=True)
class PromptKeys:
    """A request's prompt as the backend will see it."""

    tokens: np.ndarray
    max_tokens: int
    """Completion tokens asked for (the request's ``max_tokens``; when unset, vLLM's defaults: 16 for a
    completion, the rest of the model's context for a chat)."""
    namespace: Namespace
    """The model's namespace (:attr:`ModelEntry.namespace`), salted with the request's ``cache_salt``."""
    block_size: int
    hashed: dict[Namespace, list[bytes]] = field(default_factory=dict, repr=False, compare=False)
    """Keys by namespace, hashed on first use (once per vLLM version among the backends)."""

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def keys(self) -> list[bytes]:
        """Keys of the loadable leading blocks in :attr:`namespace`."""
        return self.keys_in(self.namespace)

    def keys_in(self, ns: Namespace) -> list[bytes]:
        """Keys of the loadable leading blocks in ``ns`` (one ``block_keys`` call, remembered)."""
        got = self.hashed.get(ns)
        if got is None:
            loadable = (self.n_tokens - 1) // self.block_size
            got = block_keys(ns, self.tokens[: loadable * self.block_size]) if loadable else []
            self.hashed[ns] = got
        return got


def keys_at(model: ModelEntry, prompt: PromptKeys, version: str) -> tuple[Namespace, list[bytes]] | None:
    """The namespace and loadable keys of ``prompt`` at a backend running
    vLLM ``version`` ("" = unknown); None when the namespace is unknown: the
    backend is then predicted a miss."""
    base = model.namespace_at(version)
    if base is None:
        return None
    ns = base if not prompt.namespace.salt else Namespace(**{**base.to_dict(), "salt": prompt.namespace.salt})  # type: ignore[arg-type]
    return ns, prompt.keys_in(ns)


def _model_config(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg: dict[str, Any] = json.load(f)
            return cfg
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"model {path}: cannot read config.json: {e}") from None


def block_bytes_of(cfg: Mapping[str, Any], spec: ModelSpec) -> int:
    """``2 * layers * kv_heads * head_dim * dtype bytes * block_size / tp``."""
    layers = int(cfg.get("num_hidden_layers", 1))
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", heads)) // heads)
    item = KVDtype.parse(spec.kv_dtype).itemsize
    return 2 * layers * kv_heads * head_dim * item * spec.block_size // spec.tp_size


def load_model(spec: ModelSpec, namespace_fn: NamespaceFn | None = None) -> ModelEntry:
    """Load ``spec``'s tokenizer and derive its namespace (once, at start-up)."""
    from transformers import AutoTokenizer

    cfg = _model_config(spec.path)
    tok = AutoTokenizer.from_pretrained(spec.path)
    fn = namespace_fn or shared_namespace
    ns = fn(spec)
    mml = spec.max_model_len or int(cfg.get("max_position_embeddings", 0) or 0) or 1 << 30
    return ModelEntry(spec=spec, tokenizer=tok, namespace=ns, max_model_len=mml,
                      block_bytes=block_bytes_of(cfg, spec), namespace_fn=fn)


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise BadRequest(f"{where}: only text content parts are supported by the router")
        return "\n".join(parts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts")


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        d = dict(m)
        d["content"] = _text_content(m.get("content"), f"messages[{i}]")
        out.append(d)
    return out


def _as_int(body: Mapping[str, Any], name: str, default: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest(f"'{name}' must be a non-negative integer")
    return v


def _check_text(text: str, where: str) -> None:
    """JSON may carry lone surrogates (``"\\ud800"``) that no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{where} is not valid Unicode text: {e.reason} at position {e.start}") from None


def _encode(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``tok.encode(text)``; through the Rust tokenizer without offsets when
    the tokenizer is a fast one (the same ids, about half the time)."""
    backend = getattr(tok, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is not None:
        ids: list[int] = fast([text], add_special_tokens=add_special_tokens)[0].ids
        return ids
    out: list[int] = tok.encode(text, add_special_tokens=add_special_tokens)
    return out


def request_tokens(model: ModelEntry, endpoint: Endpoint, body: Mapping[str, Any]) -> PromptKeys:
    """The prompt tokens and loadable block keys of ``body``; raises
    :class:`BadRequest` for a body the router cannot read or a prompt that
    does not fit the model."""
    tok = model.tokenizer
    if endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            _check_text(prompt, "'prompt'")
            ids = _encode(tok, prompt, bool(body.get("add_special_tokens", True)))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = prompt
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")
        max_tokens = _as_int(body, "max_tokens", 16)
    else:
        extra = body.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, Mapping):
            raise BadRequest("'chat_template_kwargs' must be an object")
        kwargs = dict(extra or {})
        if "chat_template" in kwargs:  # a client's Jinja would run here, on the router's event loop
            raise BadRequest("'chat_template_kwargs' may not carry a 'chat_template': the router renders the "
                             "model's own template (as vLLM does without --trust-request-chat-template)")
        kwargs.setdefault("add_generation_prompt", bool(body.get("add_generation_prompt", True)))
        kwargs.setdefault("continue_final_message", bool(body.get("continue_final_message", False)))
        try:
            ids = tok.apply_chat_template(_messages(body), tokenize=True, return_dict=False, **kwargs)
        except BadRequest:
            raise
        except Exception as e:  # the template rejected the conversation (or the model has none)
            raise BadRequest(f"chat template: {e}") from None
        if body.get("add_special_tokens"):
            ids = tok.encode(tok.decode(ids), add_special_tokens=True)
        max_tokens = _as_int(body, "max_completion_tokens", _as_int(body, "max_tokens", -1))  # -1: unset
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # a token id past int64: outside any vocabulary
        raise BadRequest("a prompt token id is outside the vocabulary") from None
    if arr.size == 0:
        raise BadRequest("the prompt is empty")
    vocab = getattr(tok, "vocab_size", None)
    if vocab and (arr.min() < 0 or arr.max() >= max(vocab, len(tok))):
        raise BadRequest(f"a prompt token id is outside the vocabulary (0..{max(vocab, len(tok)) - 1})")
    limit = model.max_model_len
    if max_tokens < 0:  # a chat without a limit generates up to the context, as vLLM does
        max_tokens = max(limit - int(arr.size), 0)
    if arr.size + max_tokens > limit:
        raise BadRequest(f"this model's maximum context length is {limit} tokens; the request has "
                         f"{arr.size} prompt tokens and asks for {max_tokens} more")
    ns = model.namespace
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt:
        ns = Namespace(**{**ns.to_dict(), "salt": salt})  # type: ignore[arg-type]
    return PromptKeys(tokens=arr, max_tokens=max_tokens, namespace=ns, block_size=model.spec.block_size)
