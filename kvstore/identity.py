"""What identifies a model's KV: the one namespace an engine and a router derive.

A cached block may be served only to the model that computed it. Two
engines share blocks exactly when the KV they compute for the same tokens
is the same, so the namespace names:

- the **weights** (:func:`weights_digest`, in :mod:`kvstore.weights` and
  re-exported here): the content of the weight files (and remote code),
  hashed once and remembered in a small sidecar cache keyed by each
  file's path, size, inode, device, mtime and ctime; for a Hugging Face
  cache snapshot, the blobs its weight files link to (named by their
  content hash, so nothing is read);
- the **KV-affecting config** (:func:`config_digest`): every field of
  ``config.json`` in :data:`KV_CONFIG_FIELDS`, after ``hf_overrides``, and
  every overridden field whatever its name;
- the **layout** of a block's bytes (:func:`kv_schema`): engine layout tag,
  layers, KV heads per rank, head size, block size, KV and compute dtypes,
  quantization;
- tenant, block size, KV dtype, TP size and PP stage as plain fields.

``model_id`` is derived from these (architecture + digests), not from the
path or the served name: the same weights and config at another path or
under another served name share blocks, and a weights update at the same
path does not. :func:`engine_namespace` is the ONE function that both the
vLLM connector (``engine_adapter.vllm``) and the router call, so their block
keys agree. Leaf module: stdlib and xxhash only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import KVDtype, KVLayout, Namespace
from kvstore.weights import (
    WEIGHT_SUFFIXES,
    DigestCache,
    adapter_digest,
    hf_snapshot_digest,
    weight_files,
    weights_digest,
    weights_digest_async,
)
from kvstore.weights import canonical as _canonical
from kvstore.weights import h128 as _h128

__all__ = [
    "CONFIG_FORMATS", "KV_CONFIG_FIELDS", "WEIGHT_SUFFIXES", "DigestCache", "adapter_digest", "config_digest",
    "config_geometry", "engine_namespace", "hf_snapshot_digest", "kv_schema", "load_config", "vllm_layout_tag", "weight_files",
    "weights_digest", "weights_digest_async", "window_off",
]

KV_CONFIG_FIELDS: Final[tuple[tuple[str, str], ...]] = (
    # what the model is
    ("architectures", "the model class vLLM/transformers instantiates"),
    ("model_type", "the model family (attention and norm variants)"),
    # shape of the network (KV of layer n depends on every earlier layer)
    ("hidden_size", "residual width"), ("intermediate_size", "MLP width"),
    ("num_hidden_layers", "layers that produce KV"),
    ("num_attention_heads", "query heads (and head size when head_dim is absent)"),
    ("num_key_value_heads", "KV heads (GQA/MQA)"), ("multi_query", "MQA flag of older configs"),
    ("head_dim", "KV head size"), ("vocab_size", "embedding table"),
    ("tie_word_embeddings", "which tensor embeds the tokens"), ("hidden_act", "MLP activation"),
    ("rms_norm_eps", "normalisation epsilon"), ("layer_norm_eps", "normalisation epsilon"),
    ("layer_norm_epsilon", "normalisation epsilon"), ("attention_bias", "q/k/v projection biases"),
    ("qkv_bias", "q/k/v projection biases"), ("mlp_bias", "MLP biases"),
    ("pretraining_tp", "sliced projections of some Llama checkpoints"),
    # positions: same shape, different K values
    ("rope_theta", "RoPE base frequency"), ("rope_scaling", "RoPE scaling (linear, dynamic, yarn, llama3, longrope)"),
    ("rope_parameters", "RoPE settings (newer transformers)"),
    ("partial_rotary_factor", "fraction of the head that is rotated"), ("rotary_dim", "rotated dimensions"),
    ("rotary_emb_base", "RoPE base of some families"),
    ("rotary_pct", "fraction of the head that is rotated (GPT-NeoX)"), ("rope_interleaved", "RoPE pairing"),
    ("position_embedding_type", "rope/alibi/absolute"), ("alibi", "ALiBi positions"),
    ("max_position_embeddings", "enters dynamic and yarn RoPE scaling"),
    ("original_max_position_embeddings", "enters yarn/longrope scaling"),
    # which tokens attend to which
    ("sliding_window", "attention window"), ("use_sliding_window", "whether the window applies"),
    ("max_window_layers", "layers using the window"), ("sliding_window_pattern", "interleaved local/global layers"),
    ("layer_types", "per-layer attention kind"), ("attention_chunk_size", "chunked local attention"),
    ("no_rope_layers", "layers without RoPE"), ("use_qk_norm", "q/k normalisation"),
    ("qk_layernorm", "q/k normalisation"), ("attn_logit_softcapping", "attention softcap"),
    ("final_logit_softcapping", "logit softcap"), ("query_pre_attn_scalar", "attention scale"),
    ("attention_multiplier", "attention scale (Granite)"), ("embedding_multiplier", "embedding scale (Granite)"),
    ("residual_multiplier", "residual scale (Granite)"), ("scale_embedding", "embedding scale"),
    ("logits_scaling", "logit scale"),
    # MLA and MoE
    ("kv_lora_rank", "MLA latent KV size"), ("q_lora_rank", "MLA query rank"), ("qk_nope_head_dim", "MLA head split"),
    ("qk_rope_head_dim", "MLA head split"), ("v_head_dim", "MLA value head size"), ("num_experts", "MoE experts"),
    ("num_local_experts", "MoE experts"), ("n_routed_experts", "MoE experts"),
    ("n_shared_experts", "MoE shared experts"), ("num_experts_per_tok", "MoE routing top-k"),
    ("moe_intermediate_size", "expert width"), ("norm_topk_prob", "MoE routing normalisation"),
    ("routed_scaling_factor", "MoE output scale"), ("first_k_dense_replace", "dense layers before the MoE ones"),
    ("n_group", "grouped routing"), ("topk_group", "grouped routing"), ("scoring_func", "routing score"),
    ("topk_method", "routing method"), ("decoder_sparse_step", "MoE layer spacing"),
    ("mlp_only_layers", "dense layers of a MoE model"),
    # numbers
    ("quantization_config", "quantized weights compute other activations"),
    ("compression_config", "quantized weights (compressed-tensors)"),
    ("torch_dtype", "checkpoint dtype (the compute dtype defaults to it)"),
    ("dtype", "checkpoint dtype (newer transformers)"),
    # other families' names for the same things
    ("n_embd", "residual width (GPT-2 style)"), ("n_layer", "layers (GPT-2 style)"), ("n_head", "heads"),
    ("num_layers", "layers"), ("d_model", "residual width"), ("kv_channels", "KV head size (ChatGLM)"),
    ("multi_query_group_num", "KV heads (ChatGLM)"), ("ffn_hidden_size", "MLP width"),
    ("rotary_emb_fraction", "fraction of the head that is rotated"), ("rope_ratio", "RoPE base multiplier (ChatGLM)"),
    ("parallel_attn", "attention and MLP in parallel (Falcon)"), ("use_parallel_residual", "parallel residual"),
    ("new_decoder_architecture", "Falcon decoder variant"), ("layers_block_type", "hybrid layer kinds"),
    ("attn_layer_indices", "hybrid attention layers"), ("residual_in_fp32", "residual precision"),
    ("layernorm_epsilon", "normalisation epsilon (ChatGLM)"), ("layer_rope_theta", "per-layer RoPE base"),
    ("rope_local_base_freq", "RoPE base of local layers (Gemma 3)"), ("rope_local_theta", "RoPE base of local layers"),
    ("swa_rope_theta", "RoPE base of sliding-window layers"), ("interleaved_sliding_window", "window of local layers"),
    ("dim", "residual width (Mistral params.json)"), ("n_layers", "layers"), ("n_heads", "query heads"),
    ("n_kv_heads", "KV heads"), ("hidden_dim", "MLP width"), ("norm_eps", "normalisation epsilon"),
    ("yarn", "YaRN RoPE scaling"), ("llama_4_scaling", "position-dependent query scale"), ("moe", "MoE settings"),
    ("activation", "MLP activation (Mistral params.json)"),
    ("tied_embeddings", "which tensor embeds the tokens (Mistral params.json)"),
    ("quantization", "quantized weights (Mistral params.json)"),
    ("config_format", "params.json read over config.json (vLLM's Mistral format: another model class)"),
    # nested configs of multimodal and composite models
    ("text_config", "the language model of a multimodal model"),
)
"""``(field, why)``: the ``config.json`` fields that change the KV a model
computes for the same tokens, and so enter :func:`config_digest`. A field
absent from a config is skipped (absent and ``null`` hash the same). Every
field set through ``hf_overrides`` counts too, listed here or not. Err on the
side of including a field: a wrong hit costs correctness, a miss only time."""

_FIELD_NAMES: Final = tuple(name for name, _ in KV_CONFIG_FIELDS)

_digest_weights: Final = weights_digest  # reachable where a parameter shadows the name


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


CONFIG_FORMATS: Final = ("auto", "hf", "mistral")
"""vLLM's ``--config-format`` values :func:`load_config` reads as vLLM does."""


def given_engine_version(given: object, engine: str) -> str:
    """An operator's ``engine_version`` (two versions they know compute the
    same KV given one string), checked: a non-empty string of at most 200
    characters, else InvalidArgument (a ValueError) naming ``engine``."""
    if not isinstance(given, str) or not given.strip() or len(given) > 200:
        raise InvalidArgument(f"engine_version must be a non-empty string of at most 200 characters "
                              f"(the {engine} version to name in the namespace), got {given!r}")
    return given


def _json_object(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path}: {path.name} is not a JSON object")
    return data


def load_config(model_dir: str | os.PathLike[str], config_format: str = "auto") -> dict[str, Any]:
    """The config vLLM computes with, as written (no defaults filled in,
    so every reader gets the same fields): ``config.json`` of a model
    directory, else ``params.json``; {} when there is neither, or when
    ``model_dir`` is a file (a GGUF file carries its config inside the
    weights, which the weights digest covers). In vLLM's Mistral format
    (``config_format="mistral"``, or ``"auto"`` on a directory with
    ``params.json`` and ``consolidated*.safetensors``, as vLLM detects it)
    ``params.json``'s fields over ``config.json``'s (vLLM's defaults for
    it), with ``config_format: "mistral"`` when there is a ``config.json``
    (the same directory read the other way). InvalidArgument for a format
    not in :data:`CONFIG_FORMATS`."""
    if config_format not in CONFIG_FORMATS:
        raise InvalidArgument(f"config format {config_format!r} is not one of {', '.join(CONFIG_FORMATS)}")
    base = Path(model_dir)
    if not base.is_dir():
        return {}
    hf, params = _json_object(base / "config.json"), _json_object(base / "params.json")
    if config_format == "mistral" or (config_format == "auto" and params is not None
                                      and any(base.glob("consolidated*.safetensors"))):
        return {**(hf or {}), **(params or {}), **({"config_format": "mistral"} if hf is not None else {})}
    return hf if hf is not None else (params if config_format == "auto" and params is not None else {})


def _merged(hf_config: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``hf_config`` with ``overrides`` applied as vLLM's ``hf_overrides``
    does (a nested mapping updates a nested config; anything else replaces)."""
    out = dict(hf_config)
    for k, v in (overrides or {}).items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merged(out[k], v)
        else:
            out[k] = v
    return out


def _select(cfg: Mapping[str, Any]) -> dict[str, Any]:
    sel = {}
    for name in _FIELD_NAMES:
        v = cfg.get(name)
        if v is None:
            continue
        sel[name] = _select(v) if name == "text_config" and isinstance(v, Mapping) else v
    return sel


def _unlisted(merged: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The overridden fields :func:`_select` leaves out (unlisted ones, at
    the top level and in an overridden ``text_config``), as in ``merged``."""
    out: dict[str, Any] = {}
    for k, v in sorted((overrides or {}).items()):
        if k not in _FIELD_NAMES:
            out[k] = merged[k]
        elif k == "text_config" and isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
            if nested := _unlisted(merged[k], v):
                out[k] = nested
    return out


def _nested_config(value: Any) -> bool:
    return isinstance(value, Mapping) and "model_type" in value


def config_digest(hf_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> str:
    """xxh3_128 hex over the canonical JSON of the :data:`KV_CONFIG_FIELDS`
    of ``hf_config`` after ``overrides`` (vLLM's ``hf_overrides``), plus
    every overridden field not in that list (a nested ``text_config``
    override's included), plus every dict-valued override as given but
    those of a nested config (a dict with a ``model_type``, as transformers
    writes one): vLLM sets a dict-valued field (``rope_parameters``,
    ``rope_scaling``) to the given dict and merges only into nested
    configs, so an override that leaves out a key of the config's dict runs
    with that key's default, while merging it would give the config back."""
    merged = _merged(hf_config, overrides)
    doc = {"fields": _select(merged), "overrides": _unlisted(merged, overrides)}
    if given := {k: v for k, v in sorted((overrides or {}).items())
                 if isinstance(v, Mapping) and not _nested_config(hf_config.get(k))}:
        doc["given"] = given  # (only then: the digest of every other config stays as it was)
    return _h128(_canonical(doc))


def window_off(hf_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``overrides`` plus what vLLM's ``--disable-sliding-window`` does: the
    config's window (in ``text_config`` when there) set to None; full
    attention, so other KV. No change when the config has no window."""
    merged, out = _merged(hf_config, overrides), dict(overrides or {})
    if isinstance(tc := merged.get("text_config"), Mapping) and tc.get("sliding_window"):
        out["text_config"] = {**(out.get("text_config") or {}), "sliding_window": None}
    elif merged.get("sliding_window"):
        out["sliding_window"] = None
    return out


def _text(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    tc = cfg.get("text_config")
    return tc if isinstance(tc, Mapping) and tc.get("num_hidden_layers") else cfg


def config_geometry(hf_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None,
                    tp_size: int = 1) -> tuple[int, int, int]:
    """(layers, KV heads per TP rank, head size) of a standard decoder, as
    vLLM derives them from the config; zeros where the config does not say."""
    t = _text(_merged(hf_config, overrides))
    try:
        layers = int(t.get("num_hidden_layers") or t.get("n_layer") or 0)
        heads = int(t.get("num_attention_heads") or t.get("n_head") or 0)
        if t.get("multi_query"):
            kv = 1
        else:
            kv = int(t.get("num_key_value_heads") or heads)
        head = int(t.get("head_dim") or (int(t.get("hidden_size") or 0) // heads if heads else 0))
    except (TypeError, ValueError):
        return 0, 0, 0
    return layers, max(1, kv // tp_size) if kv else 0, head


def vllm_layout_tag(device_type: str = "cuda", kv_cache_layout: str = "", tag: str = "",
                    tp_size: int = 1, engine_version: str = "") -> str:
    """The engine part of the layout schema of the vLLM connector: a block
    is vLLM's per-layer block bytes on ``device_type`` ("cuda", "cpu", ...)
    with its resolved KV cache layout ("" when vLLM leaves it unset, "NHD",
    "HND"), the connector's ``layout_tag``, and ``|vllm=<engine_version>``
    (the vLLM version that computed it; another version may compute other
    KV). ``vllm-v1`` at TP = 1; ``vllm-v1+seal`` at TP > 1, where the ranks'
    shards are followed by a seal of per-shard checksums. A router computes
    the backend's keys with the backend's values."""
    version = "vllm-v1" if tp_size <= 1 else "vllm-v1+seal"
    return f"{version}|{device_type}|{kv_cache_layout}|{tag}" + (f"|vllm={engine_version}" if engine_version else "")


def kv_schema(hf_config: Mapping[str, Any], *, block_size: int, kv_dtype: KVDtype | str,
              overrides: Mapping[str, Any] | None = None, tp_size: int = 1,
              layout_tag: str = vllm_layout_tag(), compute_dtype: str | None = None,
              quantization: str | None = None,
              geometry: tuple[int, int, int] | None = None) -> tuple[str, int]:
    """``(descriptor, schema_version)`` of the bytes of one block: the
    engine's ``layout_tag``, layers, KV heads per rank, head size (from the
    config, or ``geometry`` when the engine knows better), block size, KV
    dtype, and (when given) the compute dtype and an engine-side
    quantization method. ``schema_version`` is 31 bits of its xxh3_64 (an
    unsigned 32-bit field on the wire)."""
    kvd = KVDtype.parse(kv_dtype)
    layers, kv_heads, head = geometry or config_geometry(hf_config, overrides, tp_size)
    desc = (f"{layout_tag}|layers={layers}|kv_heads={kv_heads}|head={head}|block={block_size}|{kvd.value}")
    if compute_dtype and compute_dtype.removeprefix("torch.") != kvd.value:
        desc += f"|compute={compute_dtype.removeprefix('torch.')}"
    if quantization:
        desc += f"|quant={quantization}"
    return desc, xxhash.xxh3_64_intdigest(desc.encode()) >> 33


# --------------------------------------------------------------------------
# The namespace
# --------------------------------------------------------------------------


def _architecture(cfg: Mapping[str, Any]) -> str:
    arch = cfg.get("architectures")
    if isinstance(arch, list) and arch:
        return str(arch[0])[:96]
    return str(cfg.get("model_type") or "model")[:96]


def engine_namespace(model_dir: str | os.PathLike[str] | None, *, block_size: int, kv_dtype: KVDtype | str,
                     tp_size: int = 1, pp_stage: int = 0, tenant: str = "default",
                     hf_overrides: Mapping[str, Any] | None = None, weights_digest: str | None = None,
                     layout: KVLayout | str = KVLayout.OPAQUE, layout_tag: str = vllm_layout_tag(),
                     compute_dtype: str | None = None, quantization: str | None = None,
                     hf_config: Mapping[str, Any] | None = None, model_id: str | None = None,
                     digest_cache: str | None = None, geometry: tuple[int, int, int] | None = None,
                     disable_sliding_window: bool = False, config_format: str = "auto") -> Namespace:
    """The namespace of the KV an engine computes for the model in
    ``model_dir``: the ONE derivation shared by the vLLM connector and the
    router (same arguments, same block keys).

    - ``weights_digest``: from the weight files (:func:`weights_digest`)
      unless given (an operator's override: then the operator vouches that
      equal strings mean equal weights);
    - ``model_id``: ``<architecture>/<config digest>``, never the path or
      served name, unless given;
    - ``schema_version``: from :func:`kv_schema`;
    - ``hf_config``: the config to use instead of ``model_dir/config.json``
      (as written, no defaults filled in);
    - ``disable_sliding_window``: vLLM's flag (:func:`window_off`);
    - ``config_format``: vLLM's ``--config-format`` (:func:`load_config`).
    """
    if hf_config is None:
        if model_dir is None:
            raise InvalidArgument("engine_namespace needs model_dir or hf_config")
        hf_config = load_config(model_dir, config_format)
    if weights_digest is None:
        if model_dir is None:
            raise InvalidArgument("engine_namespace needs model_dir or weights_digest")
        weights_digest = _digest_weights(model_dir, cache=digest_cache)
    if disable_sliding_window:
        hf_overrides = window_off(hf_config, hf_overrides)
    cdig = config_digest(hf_config, hf_overrides)
    merged = _merged(hf_config, hf_overrides)
    _desc, schema = kv_schema(hf_config, block_size=block_size, kv_dtype=kv_dtype, overrides=hf_overrides,
                              tp_size=tp_size, layout_tag=layout_tag, compute_dtype=compute_dtype,
                              quantization=quantization, geometry=geometry)
    mid = model_id or f"{_architecture(merged)}/{cdig[:24]}"
    wd = weights_digest if len(weights_digest.encode()) <= 200 else "sha:" + _h128(weights_digest)
    return Namespace(tenant=tenant, model_id=mid, weights_digest=wd, kv_dtype=KVDtype.parse(kv_dtype),
                     layout=KVLayout.parse(layout), block_size=int(block_size), tp_size=int(tp_size),
                     pp_stage=int(pp_stage), schema_version=schema)

