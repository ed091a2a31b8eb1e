"""What identifies a model's weights: digests of the files an engine loads.

:func:`weights_digest` hashes the weight files (and remote code) of a
model directory once, remembering each file's digest in a small sidecar
cache (:class:`DigestCache`) keyed by its path, size, inode, device, mtime
and ctime; a Hugging Face cache snapshot is named by the blobs its weight
files link to (:func:`hf_snapshot_digest`: content hashes, so nothing is
read). :func:`adapter_digest` names a LoRA adapter the same way.
:mod:`kvstore.identity` builds the namespace on these. Leaf module: stdlib
and xxhash only.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import xxhash

from kvstore.errors import InvalidArgument

__all__ = [
    "CHUNK", "RACY_WINDOW_NS", "WEIGHT_SUFFIXES", "DigestCache", "adapter_digest", "canonical", "code_digest", "h128",
    "hf_snapshot_digest", "weight_files", "weights_digest", "weights_digest_async",
]

WEIGHT_SUFFIXES: Final[tuple[str, ...]] = (
    ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz", ".pdparams", ".tensors",
    ".safetensors.index.json", ".bin.index.json", ".pt.index.json", ".pth.index.json",
)
"""Files of a model directory that :func:`weights_digest` hashes (top level
only; vLLM loads from there)."""

CHUNK: Final = 64 << 20
"""Bytes hashed per call of the content hash."""
RACY_WINDOW_NS: Final = 2_000_000_000
"""Files changed this recently (ns) before being hashed are not cached."""
_SNAPSHOT_RE: Final = re.compile(r"^[0-9a-f]{40}$")
_CACHE_VERSION: Final = 1
_CACHE_MAX_ENTRIES: Final = 4096
_INFLIGHT_LOCK: Final = threading.Lock()
_INFLIGHT: dict[tuple[str, str, str], Future[str]] = {}


def canonical(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces); non-JSON values as their repr."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)


def h128(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def weight_files(model_dir: str | os.PathLike[str], code: bool = False) -> list[Path]:
    """The weight files :func:`weights_digest` covers, sorted by name: the
    path itself when it is a file (a ``.gguf``), else the top-level files of
    the directory ending in one of :data:`WEIGHT_SUFFIXES`; with ``code``,
    and when there are any, also its ``*.py`` files: remote code (vLLM's
    Transformers backend with ``trust_remote_code`` runs it) computes too."""
    p = Path(model_dir)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise InvalidArgument(f"model directory {str(p)!r} does not exist")
    files = sorted(f for f in p.iterdir() if f.name.endswith(WEIGHT_SUFFIXES) and f.is_file())
    return sorted(files + [f for f in p.iterdir() if f.suffix == ".py" and f.is_file()]) if code and files else files


def hf_snapshot_digest(model_dir: str | os.PathLike[str]) -> str | None:
    """For a Hugging Face cache snapshot (``.../snapshots/<40-hex commit>/``)
    whose weight files are all links into the repository's ``blobs/``:
    ``"hf:"`` + a hash of (file name, blob name) pairs. Blob names are the
    files' content hashes (SHA-256 for LFS files), checked by the download,
    so nothing is read; two commits with the same weights share it. None
    when ``model_dir`` is not such a snapshot or a weight file was replaced
    by a plain file (then the content is hashed)."""
    p = Path(model_dir)
    if not (p.is_dir() and p.parent.name == "snapshots" and _SNAPSHOT_RE.match(p.name)):
        return None
    blobs = (p.parent.parent / "blobs").resolve()
    pairs = []
    for f in weight_files(p, code=True):
        if not f.is_symlink():
            return None
        target = f.resolve()
        if target.parent != blobs:
            return None
        pairs.append((f.name, target.name, target.stat().st_size))
    if not pairs:
        return None
    return "hf:" + h128(canonical(pairs))


class DigestCache:
    """The sidecar cache of per-file content digests: a JSON file mapping a
    weight file's real path to its digest and the ``(size, inode, device,
    mtime_ns, ctime_ns)`` it had when hashed. An entry whose file changed in
    any of these is stale. Written atomically (temp file + rename), mode
    0600; a missing or corrupt cache is treated as empty.

    A file changed less than ``racy_window_ns`` before it was hashed is not
    remembered (hashed again next time): file times tick coarsely, so a
    write in the same tick as the hash could leave every stamp field equal
    (git's "racily clean" entries)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 racy_window_ns: int = RACY_WINDOW_NS) -> None:
        self.path = Path(path) if path is not None else self.default_path()
        self.racy_window_ns = racy_window_ns

    @staticmethod
    def default_path() -> Path:
        """``$KVSTORE_DIGEST_CACHE``, else ``$XDG_CACHE_HOME/kvstore/weights-digest.json``
        (``~/.cache/kvstore/weights-digest.json``)."""
        env = os.environ.get("KVSTORE_DIGEST_CACHE")
        if env:
            return Path(env)
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "kvstore" / "weights-digest.json"

    @staticmethod
    def stamp(st: os.stat_result) -> list[int]:
        """What must stay equal for a cached digest to hold."""
        return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]

    def load(self) -> dict[str, dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
                return {}
            files = data.get("files")
            return {k: v for k, v in files.items() if isinstance(v, dict)} if isinstance(files, dict) else {}
        except (OSError, ValueError, AttributeError):
            return {}

    def lookup(self, entries: Mapping[str, Mapping[str, Any]], real: str, st: os.stat_result) -> str | None:
        e = entries.get(real)
        if e is None or e.get("stamp") != self.stamp(st) or not isinstance(e.get("digest"), str):
            return None
        return str(e["digest"])

    def store(self, new: Mapping[str, Mapping[str, Any]]) -> None:
        """Merge ``new`` into the file (re-read first, so concurrent writers
        lose little) and write it atomically; failures are ignored (the
        cache only saves time)."""
        if not new:
            return
        try:
            files = self.load()
            files.update({k: dict(v) for k, v in new.items()})
            if len(files) > _CACHE_MAX_ENTRIES:
                files = dict(list(files.items())[-_CACHE_MAX_ENTRIES:])
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".weights-digest.", dir=self.path.parent)
            try:
                os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"version": _CACHE_VERSION, "files": files}, f, separators=(",", ":"))
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:
            pass


def _hash_file(path: str) -> str:
    """xxh3_128 of a file's bytes: mapped and hashed in :data:`CHUNK`
    pieces (no copy out of the page cache, where vLLM has just read the
    weights); read in pieces where mapping fails."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        try:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError):  # empty, or a file that cannot be mapped
            m = None
        if m is not None:
            with m:
                if hasattr(m, "madvise"):
                    m.madvise(mmap.MADV_SEQUENTIAL)
                view = memoryview(m)
                try:
                    for i in range(0, len(m), CHUNK):
                        h.update(view[i:i + CHUNK])
                finally:
                    view.release()
            return h.hexdigest()
        buf = bytearray(CHUNK)
        chunk = memoryview(buf)
        while n := f.readinto(buf):
            h.update(chunk[:n])
    return h.hexdigest()


def _content_digest(files: list[Path], cache: DigestCache | None, threads: int) -> str:
    entries = cache.load() if cache is not None else {}
    rows: list[tuple[str, int, str | None, str, os.stat_result]] = []
    for f in files:
        real = os.path.realpath(f)
        st = os.stat(real)
        rows.append((f.name, st.st_size, cache.lookup(entries, real, st) if cache else None, real, st))
    todo = [r for r in rows if r[2] is None]
    done: dict[str, str] = {}
    if todo:
        # biggest first, so the pool finishes together
        todo.sort(key=lambda r: -r[1])
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(todo)))) as pool:
            for r, d in zip(todo, pool.map(lambda r: _hash_file(r[3]), todo)):
                done[r[3]] = d
        if cache is not None:
            new = {}
            now = time.time_ns()
            for _name, _size, _d, real, st_before in todo:
                st_after = os.stat(real)
                changed = max(st_after.st_mtime_ns, st_after.st_ctime_ns)
                if DigestCache.stamp(st_after) == DigestCache.stamp(st_before) and \
                        now - changed >= cache.racy_window_ns:  # not changed while (or just before) hashed
                    new[real] = {"stamp": DigestCache.stamp(st_after), "digest": done[real]}
            cache.store(new)
    parts = [(name, size, d if d is not None else done[real]) for name, size, d, real, _st in rows]
    return "xxh3:" + h128(canonical(parts))


def weights_digest(model_dir: str | os.PathLike[str], *, cache: DigestCache | str | None = None,
                   use_cache: bool = True, threads: int | None = None, hf_snapshot: bool = True) -> str:
    """A digest of the model's weights that changes whenever a weight file's
    content does: ``hf:...`` for an unmodified Hugging Face cache snapshot
    (:func:`hf_snapshot_digest`), else ``xxh3:...`` over (file name, size,
    xxh3_128 of the content) of every file of :func:`weight_files`, hashed
    in parallel (``threads``, default up to 8) and remembered in the
    :class:`DigestCache` (``cache``: a path or a cache; default
    :meth:`DigestCache.default_path`), so a later start with unchanged files
    reads no weight bytes. Raises InvalidArgument when there are no weight
    files."""
    if hf_snapshot:
        snap = hf_snapshot_digest(model_dir)
        if snap is not None:
            return snap
    files = weight_files(model_dir, code=True)
    if not files:
        raise InvalidArgument(f"no weight files ({', '.join(WEIGHT_SUFFIXES[:5])}, ...) in {str(model_dir)!r}")
    dc = (cache if isinstance(cache, DigestCache) else DigestCache(cache)) if use_cache else None
    return _content_digest(files, dc, threads or min(8, os.cpu_count() or 1))


def weights_digest_async(model_dir: str | os.PathLike[str], *, cache: str | None = None) -> Future[str]:
    """:func:`weights_digest` in a background thread, shared by every caller
    in this process that asks for the same directory while it runs (two
    connector instances of one process hash once)."""
    key = (os.path.realpath(model_dir), str(cache or ""), "")
    with _INFLIGHT_LOCK:
        if (fut := _INFLIGHT.get(key)) is not None:
            return fut
        fut = _INFLIGHT[key] = Future()

    def run() -> None:
        try:
            digest: str | None = weights_digest(model_dir, cache=cache)
            error: BaseException | None = None
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            digest, error = None, e
        with _INFLIGHT_LOCK:  # shared only while it runs: a later call sees later files
            _INFLIGHT.pop(key, None)
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(str(digest))

    threading.Thread(target=run, name="kvstore-weights-digest", daemon=True).start()
    return fut


def code_digest(code_dir: str | os.PathLike[str]) -> str:
    """``"code:"`` + XXH3-128 over (file name, XXH3-128 of the content) of
    the top-level ``*.py`` files of ``code_dir`` (remote code, read whole:
    they are small); "" when it has none."""
    files = sorted(f for f in Path(code_dir).iterdir() if f.suffix == ".py" and f.is_file())
    return "code:" + h128(canonical([(f.name, _hash_file(str(f))) for f in files])) if files else ""


_ADAPTER_CONFIG_SKIP: Final = frozenset({"base_model_name_or_path", "revision", "inference_mode"})


def adapter_digest(adapter_dir: str | os.PathLike[str], *, cache: DigestCache | str | None = None) -> str:
    """The namespace ``adapter_id`` of a LoRA (PEFT) adapter directory:
    ``"lora:"`` + XXH3-128 over its ``adapter_config.json`` (every field but
    the base model's path and revision, which the namespace names already)
    and the :func:`weights_digest` of its weight files. Like the model's,
    it changes when the adapter's files do, and not with its name or path."""
    p = Path(adapter_dir)
    cfg: dict[str, Any] = {}
    cfg_path = p / "adapter_config.json"
    if cfg_path.is_file():
        with open(cfg_path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict):
            cfg = {k: v for k, v in data.items() if k not in _ADAPTER_CONFIG_SKIP}
    weights = weights_digest(p, cache=cache)
    return "lora:" + h128(canonical({"config": cfg, "weights": weights}))
