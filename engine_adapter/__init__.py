"""What runs inside an inference engine: paged KV <-> kvstore blocks
(:mod:`engine_adapter.connector`, :mod:`engine_adapter.layout`,
:mod:`engine_adapter.results`), tensor-parallel
mirrored shards (:mod:`engine_adapter.tp`) and the Hugging Face adapter
(:mod:`engine_adapter.hf`, imported on its own: it needs ``transformers``).
See docs/engine.md."""

from __future__ import annotations

from engine_adapter.connector import KVConnector
from engine_adapter.layout import PagedKVLayout
from engine_adapter.results import ConnectorStats, LoadResult, LookupInfo, SaveResult
from engine_adapter.tp import LocalGroup, TorchDistGroup, TPGroup

__all__ = ["ConnectorStats", "KVConnector", "LoadResult", "LocalGroup", "LookupInfo", "PagedKVLayout",
           "SaveResult", "TPGroup", "TorchDistGroup"]
