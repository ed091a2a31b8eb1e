"""The scheduler half of the vLLM connector (``engine_adapter.vllm``).

It hashes a request's whole prompt into block keys with one ``block_keys``
call (block size = vLLM's block size), asks the daemon with one ``Lookup``
how many leading blocks it holds, and reports the hit beyond vLLM's own
prefix cache (always leaving the last prompt token to compute). It plans,
per step, which vLLM blocks to fill from the store (loads) and which newly
computed full blocks to store (saves: prompt and generated tokens alike,
keyed over the real token ids, so a chat's next turn hits the previous
answer; see :meth:`SchedulerSide.request_finished` for the tail of a
finished request), and sends the plan to the worker as
:class:`~engine_adapter.vllm_common.KVStoreConnectorMetadata`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_adapter.vllm_common import (
    FAULT_TYPES,
    PEER_DECISIONS,
    BlockMove,
    ClusterMode,
    ConnectorIdentity,
    DaemonLink,
    KVStoreConnectorMetadata,
    KVStoreWorkerMetadata,
    local_dir,
    request_ns,
)
from kvstore import identity
from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_LEN, Namespace, block_keys, block_keys_array
from kvstore.results import ChainDecisionKind, ClusterLookup

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvstore.vllm")


@dataclass(slots=True)
class ReqState:
    """Scheduler-side state of one request."""

    request: Any
    keys: bytes
    """Keys of every full prompt block, extended over the generated tokens
    as their blocks fill (:meth:`SchedulerSide.keys_upto`)."""
    adapter: str
    """The namespace's ``adapter_id`` (:meth:`SchedulerSide.adapter_id`)."""
    salt: str
    lora: tuple[int, str, str] | None = None
    """The request's LoRA as the adapter memo names it (vLLM id, name,
    path); None without LoRA. Its files are checked once per step
    (:meth:`SchedulerSide.adapters_changed`)."""
    lora_name: str = ""
    """vLLM's name of the request's LoRA (for KV events)."""
    load: bool = True
    save: bool = True
    hit_blocks: int = 0
    """Leading blocks the daemon held at the last lookup (with a fetch
    decision: the local ones and the run a peer holds)."""
    fetch_from: int = -1
    """With a fetch decision: the first block a peer holds (the loads from
    there on fetch first); -1 otherwise."""
    looked: ClusterLookup | None = None
    """With a fetch decision: the cluster lookup that made it (the loads
    pass its run on as their fetch hint, ``ClusterLookup.hint``: the daemon
    then does not locate the run again)."""
    local_tokens: int = 0
    plan: tuple[int, int] | None = None
    """Blocks [a, b) to load in the next step."""
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    """Leading blocks known stored (or planned)."""


def lora_key(lora: Any) -> tuple[int, str, str]:
    """A vLLM ``LoRARequest`` as the adapter memo names it: (id, name, path)."""
    path = str(getattr(lora, "lora_path", None) or getattr(lora, "lora_local_path", None) or "")
    return int(getattr(lora, "lora_int_id", 0) or 0), str(getattr(lora, "lora_name", "") or ""), path


def _files_stamp(adapter_dir: str) -> tuple[Any, ...]:
    """What must stay equal for a LoRA's remembered digest to hold: its
    real directory and the (size, inode, device, mtime, ctime) of its
    ``adapter_config.json`` and weight files."""
    files = [os.path.join(adapter_dir, "adapter_config.json"), *map(str, identity.weight_files(adapter_dir, code=True))]
    return (os.path.realpath(adapter_dir),
            *((os.path.basename(f), *identity.DigestCache.stamp(os.stat(f))) for f in files if os.path.exists(f)))


def _same_files(adapter_dir: str, stamp: tuple[Any, ...], dir_stamp: list[int]) -> bool:
    """The per-step check: the directory (its entries: a file added,
    removed or renamed over; a link repointed) and the files ``stamp``
    names, a ``stat`` each, are as they were; False means "maybe
    changed" (then :func:`_files_stamp` decides)."""
    stamp_of = identity.DigestCache.stamp
    return stamp_of(os.stat(adapter_dir)) == dir_stamp and \
        all(stamp_of(os.stat(os.path.join(adapter_dir, f[0]))) == list(f[1:]) for f in stamp[1:])


class SchedulerSide:
    """Lookups and the per-step plan of one scheduler-role connector."""

    def __init__(self, ident: ConnectorIdentity, link: DaemonLink, *, block_size: int, do_load: bool,
                 do_save: bool, emit_events: bool, hash_block_size: int | None,
                 cluster: ClusterMode = ClusterMode.AUTO) -> None:
        self.ident = ident
        self.cluster = cluster
        """Whether lookups ask in cluster mode; AUTO turns OFF when the daemon says it has no cluster."""
        self.link = link
        self.block_size = block_size
        self.do_load = do_load
        self.do_save = do_save
        self.emit_events = emit_events
        self.hash_block_size = hash_block_size
        self.reqs: dict[str, ReqState] = {}
        self.finished: dict[str, ReqState] = {}
        self.tails: list[BlockMove] = []  # tail saves of finished requests, sent with the next step's plan
        self.tail_pending: set[str] = set()  # finished requests whose blocks wait for their tail save
        self.events: list[Any] = []
        self.adapters: dict[tuple[int, str, str], tuple[tuple[Any, ...], str, str, list[int]]] = {}
        """LoRA (id, name, path) -> (its files' stamps, its ``adapter_id``, its local directory, the
        directory's own stamp)."""
        self.changed: set[tuple[int, str, str]] = set()
        """LoRAs whose files changed under the same (id, name, path): not cached."""
        self.unidentified: set[tuple[int, str, str]] = set()
        """LoRAs warned about (not identified)."""
        self.lora_reqs = 0
        """Requests in ``reqs`` with a LoRA (none: a step checks no adapter files)."""

    def state(self, request: Request) -> ReqState | None:
        st = self.reqs.get(request.request_id)
        if st is not None:
            return st
        toks = request.prompt_token_ids
        if toks is None or getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None  # token ids alone do not name this prompt's KV
        base = self.ident.ns  # joins the weights hash before the first lookup
        if base is None:
            return None  # the weights could not be identified: no store for this deployment
        lora = getattr(request, "lora_request", None)
        lora_name = str(getattr(lora, "lora_name", "") or "") if lora is not None else ""
        adapter = self.adapter_id(lora) if lora is not None else ""
        if adapter is None:
            return None  # a LoRA that cannot be identified: its KV is not stored nor loaded
        salt = str(getattr(request, "cache_salt", None) or "")
        ns = request_ns(base, adapter, salt)
        try:
            keys = b"".join(block_keys(ns, np.asarray(toks, dtype=np.int64)))
        except InvalidArgument as e:  # ids no key names (vLLM skips its check without a tokenizer): a miss
            log.warning("kvstore connector: request %s is not cached (%s)", request.request_id, e)
            return None
        params = getattr(request, "kv_transfer_params", None) or {}
        st = ReqState(request, keys, adapter, salt, lora_key(lora) if lora is not None else None, lora_name,
                      load=self.do_load and params.get("kvstore_load") is not False,
                      save=self.do_save and params.get("kvstore_save") is not False)
        self.reqs[request.request_id] = st
        self.lora_reqs += st.lora is not None
        return st

    def adapter_id(self, lora: Any) -> str | None:
        """The namespace ``adapter_id`` of a LoRA: the digest of its files
        (:func:`kvstore.identity.adapter_digest`, so an adapter updated
        under the same name is a new namespace, and the same adapter under
        another name shares blocks): a local directory, or the Hugging Face
        cache snapshot of a repository id. None when its files are not on
        this host (yet: vLLM's worker may download them later) or cannot be
        hashed: a name alone would give another adapter of that name these
        blocks, so the request is not cached. Remembered per (id, name,
        path) for the process with the files' stamps (a ``stat`` each,
        checked per request): should the files change under the same id,
        name and path (vLLM's ``load_inplace`` reload, or files rewritten
        in place), which version a request computes with depends on when
        vLLM's worker reloads them, so that adapter is not cached again in
        this process (loaded under a new name, it is a new id)."""
        memo_key = lora_key(lora)
        _, name, path = memo_key
        if memo_key in self.changed:
            return None
        local = local_dir(path) if path else None
        try:
            if local is None or not os.path.isdir(local):
                raise FileNotFoundError(f"no adapter directory or cached repository {path!r}")
            dir_stamp = identity.DigestCache.stamp(os.stat(local))
            stamp = _files_stamp(local)
            got = self.adapters.get(memo_key)
            if got is not None and got[0] != stamp:
                self.adapter_moved(memo_key)
                return None
            if got is None:
                got = (stamp, identity.adapter_digest(local), local, dir_stamp)
                if _files_stamp(local) != stamp:  # changed while hashed: try again next request
                    return None
                self.adapters[memo_key] = got
        except (OSError, ValueError) as e:  # not here, no weight files, unreadable: unidentified
            if memo_key not in self.unidentified:
                self.unidentified.add(memo_key)
                log.warning("kvstore connector: cannot identify LoRA %s (%s); its requests are not cached",
                            name, e)
            return None
        return got[1]

    def adapter_moved(self, memo_key: tuple[int, str, str]) -> None:
        """Mark a LoRA whose files changed under the same (id, name, path):
        not cached again in this process; one warning."""
        self.changed.add(memo_key)
        self.adapters.pop(memo_key, None)
        log.warning("kvstore connector: the files of LoRA %s (%s) changed under the same vLLM id; its requests "
                    "are no longer cached, those in flight included (load it under a new name to cache it)",
                    memo_key[1], memo_key[2])

    def adapters_changed(self, loras: set[tuple[int, str, str]]) -> set[tuple[int, str, str]]:
        """Which of ``loras`` (the adapters of this step's requests) no
        longer have the files their digest was taken from: a ``stat`` per
        file of each, once per step (requests without LoRA cost nothing).
        A request planned under the old digest would otherwise save (or
        load) blocks computed with the new weights under it."""
        out = loras & self.changed
        for memo_key in loras - out:
            got = self.adapters.get(memo_key)
            same = False
            try:
                if got is not None:
                    stamp, digest, local, dir_stamp = got
                    if _same_files(local, stamp, dir_stamp):
                        continue
                    dir_stamp = identity.DigestCache.stamp(os.stat(local))
                    same = _files_stamp(local) == stamp
                    if same:  # only the directory changed (another file in it): remember its new stamp
                        self.adapters[memo_key] = (stamp, digest, local, dir_stamp)
            except (OSError, ValueError):  # gone or unreadable: not the files the digest names
                same = False
            if not same:
                self.adapter_moved(memo_key)
                out.add(memo_key)
        return out

    def drop_changed(self, st: ReqState) -> None:
        """Stop storing and loading a request whose LoRA's files changed
        since it was planned (counted, ``lora_changed_requests``)."""
        if st.save or st.load:
            st.save = st.load = False
            self.link.stats["lora_changed_requests"] += 1
            self.link.record(event="lora_changed", req=st.request.request_id)

    def keys_upto(self, st: ReqState, n: int) -> int:
        """Make ``st.keys`` cover the first ``n`` full blocks of the
        request's real tokens (prompt + generated, never speculative drafts
        or async-scheduling placeholders) and return how many blocks it
        covers now (``n`` or fewer when fewer tokens are known). The chain
        is recomputed over the whole known prefix once per newly filled block
        (one native hash call, no per-token Python)."""
        have = len(st.keys) // KEY_LEN
        if n <= have:
            return n
        req = st.request
        n = min(n, int(req.num_tokens) // self.block_size)
        if n <= have:
            return have
        base = self.ident.ns
        assert base is not None  # a request has state only once the namespace is known
        toks = np.asarray(req.all_token_ids[:n * self.block_size], dtype=np.int64)
        st.keys = block_keys_array(request_ns(base, st.adapter, st.salt), toks).tobytes()
        return n

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self.state(request) if self.do_load or self.do_save else None
        if st is None or not st.load:
            return 0, False
        st.local_tokens = num_computed_tokens
        # the last prompt token is always computed (its logits give the first output)
        loadable = min(len(st.keys) // KEY_LEN, (request.num_tokens - 1) // self.block_size)
        if loadable * self.block_size <= num_computed_tokens:
            return 0, False  # vLLM holds every loadable block already: no need to ask
        t0 = time.perf_counter()
        c = self.link.client()
        base = self.ident.ns
        if c is None or base is None:
            return 0, False
        ns, keys = request_ns(base, st.adapter, st.salt), st.keys[:loadable * KEY_LEN]  # (packed, as sent)
        st.fetch_from, st.looked = -1, None
        cluster: dict[str, Any] = {}
        try:
            if self.cluster is ClusterMode.OFF:
                hit = int(c.lookup(ns, keys).hit_blocks)
            else:
                hit, cluster = self.cluster_lookup(c, st, ns, keys)
        except FAULT_TYPES as e:
            self.link.fault("lookup", e)
            return 0, False
        self.link.stats["lookups"] += 1
        st.hit_blocks = hit
        ext = max(0, min(hit, loadable) * self.block_size - num_computed_tokens)
        self.link.record(event="lookup", req=request.request_id, prompt_blocks=len(st.keys) // KEY_LEN,
                         local_tokens=num_computed_tokens, hit_blocks=hit, external_tokens=ext,
                         ms=round((time.perf_counter() - t0) * 1000, 3), **cluster)
        return ext, False

    def cluster_lookup(self, c: Any, st: ReqState, ns: Namespace, keys: bytes) -> tuple[int, dict[str, Any]]:
        """A cluster-mode lookup (docs/cluster.md): the blocks to report as
        external (the local prefix, plus the run a peer holds when the
        daemon's decision is fetch) and the decision's record fields. Sets
        ``st.fetch_from`` when the loads must fetch first."""
        cl = c.cluster_lookup(ns, keys)
        if cl.status == "cluster off":
            if self.cluster is ClusterMode.AUTO:
                self.cluster = ClusterMode.OFF  # a daemon without a cluster: plain lookups from now on
                log.info("kvstore connector: the daemon has no cluster; lookups are local only")
            return int(cl.local_blocks), {}
        kind = cl.decision
        stats = self.link.stats
        stats["cluster_lookups"] += 1
        stats[f"decision_{kind.value}"] += 1
        PEER_DECISIONS.labels(kind.value).inc()
        hit = int(cl.local_blocks)
        peer = next((x.peer for x in cl.locations if x.peer), "")
        if kind is ChainDecisionKind.FETCH and cl.remote_blocks:
            st.fetch_from, st.looked = hit, cl
            hit += int(cl.remote_blocks)
            stats["remote_blocks"] += int(cl.remote_blocks)
        if cl.remote_blocks:
            log.info("kvstore connector: request %s: %d local block(s), %d at %s: %s (fetch %.2f ms, "
                     "recompute %.2f ms)", st.request.request_id, cl.local_blocks, cl.remote_blocks, peer,
                     kind.value, cl.fetch_s * 1e3, cl.recompute_s * 1e3)
        return hit, {"decision": kind.value, "local_blocks": int(cl.local_blocks),
                     "remote_blocks": int(cl.remote_blocks), "peer": peer, "fetch_ms": round(cl.fetch_s * 1e3, 3),
                     "recompute_ms": round(cl.recompute_s * 1e3, 3), "cluster_status": cl.status}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens > 0:
            a = st.local_tokens // self.block_size
            b = (st.local_tokens + num_external_tokens) // self.block_size
            st.plan = (a, b)
            self.link.stats["hit_tokens"] += num_external_tokens
        # blocks below max(local hit, daemon hit) are stored already (a local
        # hit was saved when this process first computed or loaded it)
        st.saved = max(st.hit_blocks, st.local_tokens // self.block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(saves=self.tails)
        self.tails = []
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(nb[0]) if nb is not None else []
                st.saved = min(st.saved, cached.num_computed_tokens[i] // self.block_size)
            elif nb is not None:
                st.block_ids.extend(nb[0])
            computed[req_id] = cached.num_computed_tokens[i]
        changed = self.adapters_changed({st.lora for r in computed if (st := self.reqs[r]).lora is not None}) \
            if self.lora_reqs else set()
        for req_id, done in computed.items():
            st = self.reqs[req_id]
            if changed and st.lora in changed:
                self.drop_changed(st)
            if st.plan is not None:
                a, b = st.plan
                st.plan = None
                if not st.load and b <= len(st.block_ids):  # dropped since planned: no keys, vLLM recomputes
                    meta.loads.append(BlockMove(req_id, st.adapter, st.salt, b"", st.block_ids[a:b], a))
                elif b <= len(st.block_ids):
                    meta.loads.append(BlockMove(req_id, st.adapter, st.salt, st.keys[a * KEY_LEN:b * KEY_LEN],
                                                st.block_ids[a:b], a, cluster=0 <= st.fetch_from < b,
                                                peer=st.looked.hint(a, b) if st.looked else ("", 0, 0)))
                else:  # cannot happen: vLLM allocates a block for every computed token
                    log.error("kvstore: request %s has %d blocks, the load needs %d", req_id,
                              len(st.block_ids), b)
            if not st.save:
                continue
            # blocks whose every token has KV once this step ran; keys only
            # over tokens the scheduler knows (drafts and placeholders wait)
            after = done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = self.keys_upto(st, min(after // self.block_size, len(st.block_ids)))
            if full > st.saved:
                s = st.saved
                parent = st.keys[(s - 1) * KEY_LEN:s * KEY_LEN] if s else b""
                meta.saves.append(BlockMove(req_id, st.adapter, st.salt, st.keys[s * KEY_LEN:full * KEY_LEN],
                                            st.block_ids[s:full], s, parent))
                st.saved = full
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        bad = getattr(connector_output, "invalid_block_ids", None)
        if bad:  # blocks that failed to load are recomputed by vLLM: store them again afterwards
            for st in self.reqs.values():
                first = next((i for i, b in enumerate(st.block_ids) if b in bad), None)
                if first is not None:
                    st.saved = min(st.saved, first)
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if self.hash_block_size not in (None, self.block_size) or not self.emit_events:
            wm = None  # events off, or vLLM's block hashes use another granularity than our blocks
        if isinstance(wm, KVStoreWorkerMetadata):
            for req_id, ranges in wm.stored.items():
                owner = self.reqs.get(req_id) or self.finished.get(req_id)
                if owner is None:
                    continue
                for a, b in ranges:
                    if b > a:
                        self.events.append(self.stored_event(owner, a, b))
        self.tail_pending.difference_update(getattr(connector_output, "finished_sending", None) or ())
        # a finished request's state is kept until its last save is reported
        self.finished = {k: v for k, v in self.finished.items() if k in self.tail_pending}

    def stored_event(self, st: ReqState, start: int, end: int) -> Any:
        """vLLM's BlockStored (medium "kvstore") for the request's blocks
        [start, end) now in kvstore, named by vLLM's own block hashes so a
        router that follows vLLM's KV events can tell these prefixes are there."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        req = st.request
        hashes = list(getattr(req, "block_hashes", []) or [])
        end = min(end, len(hashes))
        toks = list(req.all_token_ids[start * self.block_size:end * self.block_size])
        lora = getattr(req, "lora_request", None)
        return BlockStored(block_hashes=[maybe_convert_block_hash(h) for h in hashes[start:end]],
                           parent_block_hash=maybe_convert_block_hash(hashes[start - 1]) if start else None,
                           token_ids=toks, block_size=self.block_size,
                           lora_id=getattr(lora, "lora_int_id", None) if lora else None,
                           medium="kvstore", lora_name=st.lora_name or None)

    def take_events(self) -> list[Any]:
        ev, self.events = self.events, []
        return ev

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous (in ``wait_for_save`` of the step that
        computed the block), so vLLM may usually free the blocks at once.
        A request that finished normally may still hold full blocks not yet
        saved: those whose last tokens were only known to the scheduler
        after their step was planned (async scheduling, speculative
        decoding). Then the tail goes with the next step's plan and the
        blocks stay allocated (return True) until the worker reports it
        done through ``get_finished``. Only tokens with KV count: the last
        sampled token has none."""
        from vllm.v1.request import RequestStatus

        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self.lora_reqs -= st.lora is not None
        if len(self.finished) < 4096:
            self.finished[request.request_id] = st  # until its last save is reported
        if st.lora is not None and st.save and self.adapters_changed({st.lora}):
            self.drop_changed(st)
        if not st.save or request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None  # aborted/errored: its KV may be incomplete or invalid
        with_kv = min(int(request.num_computed_tokens), int(request.num_tokens) - 1)
        full = self.keys_upto(st, min(with_kv // self.block_size, len(block_ids)))
        if full <= st.saved:
            return False, None
        s = st.saved
        parent = st.keys[(s - 1) * KEY_LEN:s * KEY_LEN] if s else b""
        self.tails.append(BlockMove(request.request_id, st.adapter, st.salt, st.keys[s * KEY_LEN:full * KEY_LEN],
                                    list(block_ids[s:full]), s, parent, final=True))
        st.saved = full
        self.tail_pending.add(request.request_id)
        self.link.record(event="tail", req=request.request_id, first=s, blocks=full - s)
        return True, None
