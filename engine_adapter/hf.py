"""Hugging Face ``transformers`` adapter: ``DynamicCache`` <-> store blocks.

:class:`HFPrefixCache` wraps a causal LM (Llama-style: ``q/k/v/o_proj``
attention and ``gate/up/down_proj`` MLP, which covers Llama, Mistral, Qwen2
and friends). Per request it loads the longest cached prefix from the
daemon into a fresh ``DynamicCache``, computes only the suffix, and saves
the prompt's full blocks afterwards. It goes through
:class:`~engine_adapter.connector.KVConnector` with a page pool of its own
(``[layers, 2, pages, block_size, kv_heads, head_dim]``, page ``i`` holding
tokens ``[i * block_size, (i + 1) * block_size)``), so the HF path exercises
exactly the code a paged engine uses.

Tensor parallelism: :func:`shard_model` splits a model in place over a
``torch.distributed`` group the Megatron way (attention heads and MLP
columns split, ``o_proj``/``down_proj`` outputs summed with an all-reduce),
so each rank's ``DynamicCache`` holds only its KV heads: exactly the shard
it stores. Compute :func:`weights_digest` *before* sharding (all ranks must
name the same namespace).

Nothing here downloads anything: :func:`build_model` makes a model from a
config with seeded random weights (tests, the demo and the benchmark).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from engine_adapter.connector import KVConnector, LoadResult, SaveResult
from engine_adapter.layout import PagedKVLayout, kv_dtype_of
from engine_adapter.tp import LocalGroup, TorchDistGroup, TPGroup, shard_heads
from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.identity import engine_namespace, given_engine_version
from kvstore.keys import KVLayout, Namespace

__all__ = ["Generation", "HFPrefixCache", "build_model", "check_tp", "greedy_generate", "llama_config",
           "engine_version", "model_namespace", "new_cache", "shard_model", "weights_digest"]


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def llama_config(**overrides: Any) -> Any:
    """A small Llama ``LlamaConfig`` (overridable field by field)."""
    from transformers import LlamaConfig

    base: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(overrides)
    return LlamaConfig(**base)


def build_model(config: Any, seed: int = 0, dtype: torch.dtype = torch.float32,
                attn_implementation: str = "sdpa") -> Any:
    """A ``LlamaForCausalLM`` with seeded random weights (no download), in eval mode."""
    from transformers import LlamaForCausalLM

    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype)  # type: ignore[call-arg]
    return model.eval()


def weights_digest(model: Any) -> str:
    """xxh3_128 hex of every parameter's name, shape, dtype and bytes (the
    namespace's ``weights_digest``). Compute it before :func:`shard_model`."""
    h = xxhash.xxh3_128()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _text_config(model_or_config: Any) -> Any:
    cfg = getattr(model_or_config, "config", model_or_config)
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _kv_heads(cfg: Any) -> int:
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def check_tp(model_or_config: Any, tp_size: int) -> None:
    """InvalidArgument unless the model's heads and MLP split evenly over ``tp_size`` ranks."""
    cfg = _text_config(model_or_config)
    shard_heads(int(cfg.num_attention_heads), tp_size, "attention heads")
    shard_heads(_kv_heads(cfg), tp_size, "KV heads")
    if int(cfg.intermediate_size) % tp_size:
        raise InvalidArgument(f"intermediate_size {cfg.intermediate_size} cannot be split evenly over "
                              f"{tp_size} tensor-parallel ranks")


HF_LAYOUT_TAG = "hf-dynamic-cache|layer_kv_page"
"""The engine part of the HF adapter's layout schema (:func:`kvstore.identity.kv_schema`),
followed by ``|hf=<engine_version>``."""


def engine_version(given: str | None = None) -> str:
    """The library versions the namespace names: ``transformers=<v>,torch=<v>``
    (an upgrade of either may compute other KV: another attention kernel,
    RoPE or norm implementation), or ``given`` (an operator who knows two
    versions compute the same KV gives both the same string); an empty
    or overlong one is refused (InvalidArgument)."""
    if given is None:
        import transformers

        return f"transformers={transformers.__version__},torch={torch.__version__}"
    return given_engine_version(given, "library")


def model_namespace(model: Any, *, tenant: str = "default", block_size: int = 16, tp_size: int = 1,
                    model_id: str | None = None, digest: str | None = None,
                    dtype: torch.dtype | None = None, engine_version: str | None = None) -> Namespace:
    """The namespace of ``model``'s KV, from the same function the vLLM
    connector and the router use (:func:`kvstore.identity.engine_namespace`):
    weights digest (computed from the parameters when not given: do it
    before sharding), the KV-affecting config fields
    (:data:`kvstore.identity.KV_CONFIG_FIELDS`, read from ``model.config``),
    model id derived from them (unless given), KV dtype, layout, block
    size, TP size, and the schema version of the layout, which names the
    transformers and torch versions (:func:`engine_version`; ``engine_version``
    replaces them)."""
    cfg = getattr(model, "config", model)
    to_dict = getattr(cfg, "to_dict", None)
    hf_config = dict(to_dict()) if callable(to_dict) else {}
    if dtype is None:
        dtype = next(model.parameters()).dtype
    tag = f"{HF_LAYOUT_TAG}|hf={_engine_version(engine_version)}"
    return engine_namespace(None, hf_config=hf_config, weights_digest=digest or weights_digest(model),
                            block_size=block_size, kv_dtype=kv_dtype_of(dtype), tp_size=tp_size, tenant=tenant,
                            layout=KVLayout.LAYER_KV_PAGE, layout_tag=tag, compute_dtype=str(dtype),
                            model_id=model_id)


_engine_version = engine_version  # reachable where a parameter shadows the name


def _decoder_layers(model: Any) -> Any:
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(dec, "layers", None)
    if layers is None:
        raise InvalidArgument(f"{type(model).__name__}: no decoder layers found")
    return layers


def _split_rows(lin: torch.nn.Linear, tp: int, rank: int) -> None:
    """Column-parallel: keep this rank's output features."""
    n = lin.out_features // tp
    sl = slice(rank * n, (rank + 1) * n)
    lin.weight = torch.nn.Parameter(lin.weight.data[sl].clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = torch.nn.Parameter(lin.bias.data[sl].clone(), requires_grad=False)
    lin.out_features = n


def _split_cols(lin: torch.nn.Linear, tp: int, rank: int, group: TorchDistGroup) -> None:
    """Row-parallel: keep this rank's input features; outputs are summed over ranks."""
    n = lin.in_features // tp
    lin.weight = torch.nn.Parameter(lin.weight.data[:, rank * n:(rank + 1) * n].clone(), requires_grad=False)
    if lin.bias is not None and rank != 0:
        lin.bias = torch.nn.Parameter(torch.zeros_like(lin.bias.data), requires_grad=False)
    lin.in_features = n

    def all_reduce(_mod: Any, _inp: Any, out: torch.Tensor) -> torch.Tensor:
        group.all_reduce_sum(out)
        return out

    lin.register_forward_hook(all_reduce)


def shard_model(model: Any, group: TorchDistGroup) -> None:
    """Split a Llama-style model in place over ``group`` (tensor parallel).

    Raises InvalidArgument (before changing anything) when the heads or MLP
    do not divide evenly or the layers are not Llama-style."""
    tp, rank = group.size, group.rank
    check_tp(model, tp)
    layers = _decoder_layers(model)
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(not isinstance(getattr(m, n, None), torch.nn.Linear) for m, n in names):
            raise InvalidArgument(f"{type(model).__name__}: shard_model supports Llama-style layers "
                                  "(self_attn.q/k/v/o_proj, mlp.gate/up/down_proj)")
    if tp == 1:
        return
    with torch.no_grad():
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _split_rows(lin, tp, rank)
            _split_cols(attn.o_proj, tp, rank, group)
            _split_cols(mlp.down_proj, tp, rank, group)
            for attr in ("num_heads", "num_key_value_heads"):
                if isinstance(getattr(attn, attr, None), int):
                    setattr(attn, attr, getattr(attn, attr) // tp)


# --------------------------------------------------------------------------
# Caches and generation
# --------------------------------------------------------------------------


def new_cache(model: Any) -> Any:
    """An empty ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _forward_kwargs(model: Any) -> tuple[str, bool]:
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def _prompt(input_ids: Any) -> torch.Tensor:
    t = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids)
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise InvalidArgument(f"one request at a time: input_ids has batch {t.shape[0]}")
        t = t[0]
    if t.dim() != 1 or t.numel() == 0:
        raise InvalidArgument(f"input_ids must be a non-empty 1-D (or [1, T]) tensor, got {tuple(t.shape)}")
    return t.to(torch.int64)


@dataclass(slots=True)
class Generation:
    """One request's outcome."""

    tokens: list[int]
    """Generated token ids (greedy)."""
    first_logits: torch.Tensor
    """Logits of the first generated token (float32, CPU)."""
    ttft_s: float
    """Request start (before the cache lookup) to the first token."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV came from the store."""
    load: LoadResult | None = None
    save: SaveResult | None = None
    load_s: float = 0.0
    """Seconds spent in the store load (lookup + copies), part of ``ttft_s``."""


@torch.no_grad()
def greedy_generate(model: Any, input_ids: Any, max_new_tokens: int, cache: Any = None,
                    t0: float | None = None) -> tuple[list[int], torch.Tensor, float, Any]:
    """Greedy decoding from ``cache`` (holding a prefix of the prompt, or
    None/empty for a full prefill). Returns (tokens, first-token logits,
    seconds to the first token from ``t0``, the cache)."""
    t0 = time.perf_counter() if t0 is None else t0
    ids = _prompt(input_ids).to(next(model.parameters()).device)
    cache = new_cache(model) if cache is None else cache
    kw, keep = _forward_kwargs(model)
    extra: dict[str, Any] = {"logits_to_keep": 1} if keep else {}
    done = cache.get_seq_length()
    out = model(ids[done:].unsqueeze(0), use_cache=True, **{kw: cache}, **extra)
    logits = out.logits[0, -1].float()
    tok = int(torch.argmax(logits))
    ttft = time.perf_counter() - t0
    first = logits.cpu().clone()
    tokens = [tok]
    for _ in range(max_new_tokens - 1):
        step = torch.tensor([[tok]], device=ids.device)
        out = model(step, use_cache=True, **{kw: cache}, **extra)
        tok = int(torch.argmax(out.logits[0, -1]))
        tokens.append(tok)
    return tokens, first, ttft, cache


class HFPrefixCache:
    """Prefix caching for a Hugging Face causal LM through the kvstore daemon.

    ``ns``: from :func:`model_namespace` (``tp_size`` = the group's size).
    ``group``: the TP group when the model was split with :func:`shard_model`.
    ``max_tokens``: longest prompt (sizes the page pool; default the model's
    ``max_position_embeddings``). Other arguments go to :class:`KVConnector`.
    """

    def __init__(self, model: Any, ns: Namespace, *, target: str | None = None, client: Client | None = None,
                 group: TPGroup | None = None, max_tokens: int | None = None, timeout: float = 5.0,
                 retry_interval: float = 1.0) -> None:
        self.model = model
        group = group if group is not None else LocalGroup()
        cfg = _text_config(model)
        check_tp(cfg, group.size)
        kv_local = shard_heads(_kv_heads(cfg), group.size)
        hd = _head_dim(cfg)
        k_proj = _decoder_layers(model)[0].self_attn.k_proj
        if k_proj.out_features != kv_local * hd:
            raise InvalidArgument(f"layer 0 computes {k_proj.out_features // hd} KV heads but a rank of a "
                                  f"TP={group.size} group holds {kv_local}: shard the model with shard_model()")
        p = next(model.parameters())
        bs = ns.block_size
        max_tokens = int(max_tokens or getattr(cfg, "max_position_embeddings", None) or 4096)
        self.layout = PagedKVLayout(KVLayout.LAYER_KV_PAGE, int(cfg.num_hidden_layers), -(-max_tokens // bs),
                                    bs, kv_local, hd, p.dtype)
        self.pages = torch.zeros(self.layout.tensor_shape, dtype=p.dtype, device=p.device)
        self.page_table = torch.arange(self.layout.num_pages)
        self.connector = KVConnector(ns, self.layout, target=target, client=client, group=group,
                                     timeout=timeout, retry_interval=retry_interval)
        self.ns = ns
        self.block_size = bs

    def close(self) -> None:
        self.connector.close()

    def __enter__(self) -> "HFPrefixCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_len(self, n: int) -> None:
        if n > self.layout.num_pages * self.block_size:
            raise InvalidArgument(f"prompt of {n} tokens is longer than max_tokens "
                                  f"({self.layout.num_pages * self.block_size})")

    def load(self, input_ids: Any) -> tuple[Any, LoadResult]:
        """A ``DynamicCache`` holding the longest cached prefix of the prompt
        (whole blocks, leaving at least one token to compute), and what loaded."""
        ids = _prompt(input_ids).cpu()
        self._check_len(int(ids.numel()))
        res = self.connector.load(ids, self.page_table, self.pages,
                                  max_blocks=(int(ids.numel()) - 1) // self.block_size)
        cache = new_cache(self.model)
        n = res.loaded_tokens
        if n:
            nb, kvh, hd = res.loaded_blocks, self.layout.kv_heads, self.layout.head_dim
            for layer in range(self.layout.num_layers):
                k = self.pages[layer, 0, :nb].reshape(n, kvh, hd).transpose(0, 1).unsqueeze(0)
                v = self.pages[layer, 1, :nb].reshape(n, kvh, hd).transpose(0, 1).unsqueeze(0)
                cache.update(k, v, layer)  # copies out of the pool (DynamicCache concatenates)
        return cache, res

    def save(self, input_ids: Any, cache: Any, start_block: int = 0) -> SaveResult:
        """Store the prompt's full blocks from ``cache`` (which holds at least
        the prompt's positions), from ``start_block`` on (block
        ``start_block - 1`` must be stored already)."""
        return self._save(input_ids, cache, start_block, start_block)

    def _first_held(self, cache: Any) -> int:
        """The first position every layer of ``cache`` still holds (0 unless
        a sliding-window layer dropped the oldest ones)."""
        total = cache.get_seq_length()
        return max(total - int(_layer_kv(cache, layer)[0].shape[-2]) for layer in range(self.layout.num_layers))

    def _save(self, input_ids: Any, cache: Any, copy_from: int, start_block: int) -> SaveResult:
        """Copy blocks ``[copy_from, nb)`` of ``cache`` into the page pool
        (earlier pages already hold this prompt's blocks) and save from
        ``start_block``."""
        ids = _prompt(input_ids).cpu()
        self._check_len(int(ids.numel()))
        nb = min(int(ids.numel()), cache.get_seq_length()) // self.block_size
        if nb == 0:
            return SaveResult(0, ())
        bs, kvh, hd = self.block_size, self.layout.kv_heads, self.layout.head_dim
        a = min(copy_from, nb)
        if a < nb and self._first_held(cache) > a * bs:
            # a sliding-window layer no longer holds the first positions to
            # copy: its tensor starts later, so indexing it from position
            # ``a * bs`` would store other positions' KV under these keys.
            # Save only the blocks the pool already holds.
            nb = a
            if nb == 0:
                return SaveResult(0, ())
        if a < nb:
            for layer in range(self.layout.num_layers):
                k, v = _layer_kv(cache, layer)
                self.pages[layer, 0, a:nb].view(-1, kvh, hd).copy_(k[0, :, a * bs:nb * bs].transpose(0, 1))
                self.pages[layer, 1, a:nb].view(-1, kvh, hd).copy_(v[0, :, a * bs:nb * bs].transpose(0, 1))
        return self.connector.save(ids[:nb * bs], self.page_table, self.pages, start_block=min(start_block, nb))

    @torch.no_grad()
    def generate(self, input_ids: Any, max_new_tokens: int = 32, *, use_store: bool = True,
                 save: bool = True) -> Generation:
        """Greedy generation; with ``use_store`` the cached prefix is loaded
        and only the rest of the prompt is computed; with ``save`` the
        prompt's blocks are stored afterwards (after the first token)."""
        ids = _prompt(input_ids)
        t0 = time.perf_counter()
        cache, load = (self.load(ids) if use_store else (None, None))
        load_s = time.perf_counter() - t0
        tokens, first, ttft, cache = greedy_generate(self.model, ids, max_new_tokens, cache, t0)
        saved = None
        if save:
            # the pool's first loaded_blocks pages still hold the loaded
            # blocks: copy only the computed ones, and save from block 0 so
            # that blocks the daemon already has are merely EXISTS
            saved = self._save(ids, cache, load.loaded_blocks if load else 0, 0)
        return Generation(tokens, first, ttft, int(ids.numel()), load.loaded_tokens if load else 0,
                          load, saved, load_s if use_store else 0.0)
