"""What the ``kvstore`` commands read: token files, namespace flags, daemon
flags, the JSON files they write, and the bad-input error (:class:`CLIError`,
exit code 2)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NoReturn

import numpy as np

from kvstore.keys import Namespace

__all__ = ["DEFAULT_TARGET", "CLIError", "Request", "add_daemon_flags", "add_namespace_flags", "check_output",
           "fail", "write_json",
           "load_request", "load_tokens", "make_namespace", "positive_int"]

DEFAULT_TARGET = "127.0.0.1:50051"


class CLIError(Exception):
    """Bad input: printed as ``kvstore: <message>``; exit code ``code`` (2)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str) -> NoReturn:
    raise CLIError(message)


@dataclass(slots=True)
class Request:
    """Tokens from a file, and the namespace fields a JSON request file names."""

    path: str
    tokens: np.ndarray
    namespace: dict[str, Any]


def load_request(path: str) -> Request:
    """Read a token file: whitespace/comma separated ints, a JSON list of
    ints, or a JSON object with "tokens" (and optionally "namespace"). "-"
    reads stdin. Raises CLIError with the path and the problem."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"token file {path!r} not found")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read token file {path!r}: {e}")
    body = text.strip()
    ns: dict[str, Any] = {}
    raw: Any
    if body[:1] in ("[", "{"):
        try:
            raw = json.loads(body)
        except json.JSONDecodeError as e:
            fail(f"token file {path!r} is not valid JSON: {e}")
        if isinstance(raw, dict):
            if "tokens" not in raw:
                fail(f"token file {path!r}: a JSON object needs a \"tokens\" list "
                      f"(keys found: {', '.join(map(str, raw)) or 'none'})")
            got_ns = raw.get("namespace", {})
            if not isinstance(got_ns, dict):
                fail(f"token file {path!r}: \"namespace\" must be an object")
            ns, raw = dict(got_ns), raw["tokens"]
        if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                for x in raw):
            fail(f"token file {path!r}: \"tokens\" must be a list of integers")
        try:
            arr = np.asarray(raw, dtype=np.int64) if raw else np.zeros(0, np.int64)
        except OverflowError:
            fail(f"token file {path!r}: token ids must be in [0, 2**32)")
    else:
        parts = body.replace(",", " ").split()
        try:
            arr = np.asarray([int(p) for p in parts], dtype=np.int64)
        except ValueError:
            bad = next(i for i, p in enumerate(parts) if not p.lstrip("+-").isdigit())
            fail(f"token file {path!r}: item {bad} ({parts[bad][:20]!r}) is not an integer "
                  "token id; expected integers separated by spaces or commas, a JSON list, "
                  'or a JSON object with "tokens"')
        except OverflowError:
            fail(f"token file {path!r}: token ids must be in [0, 2**32)")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        i = int(np.flatnonzero((arr < 0) | (arr >= 1 << 32))[0])
        fail(f"token file {path!r}: token {i} = {int(arr[i])} is out of range [0, 2**32)")
    return Request(path, arr.astype(np.uint32), ns)


def load_tokens(path: str) -> np.ndarray:
    """Only the tokens of :func:`load_request` (uint32 array)."""
    return load_request(path).tokens


_NS_FLAGS = {"tenant": "tenant", "model": "model_id", "weights_digest": "weights_digest",
             "adapter": "adapter_id", "kv_dtype": "kv_dtype", "layout": "layout",
             "block_size": "block_size", "tp": "tp_size", "pp_stage": "pp_stage",
             "schema_version": "schema_version", "hash_algo": "hash_algo"}


def add_namespace_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("namespace (flags override --namespace-json and the request file)")
    g.add_argument("--namespace-json", metavar="JSON|FILE",
                   help="namespace as a JSON object, or a file holding one")
    g.add_argument("--tenant", help='default "default"')
    g.add_argument("--model", help='model id; default "default"')
    g.add_argument("--weights-digest")
    g.add_argument("--adapter", help="LoRA adapter id")
    g.add_argument("--kv-dtype")
    g.add_argument("--layout")
    g.add_argument("--block-size", type=int, help="tokens per block (default 16)")
    g.add_argument("--tp", type=int, help="TP size of the namespace")
    g.add_argument("--pp-stage", type=int)
    g.add_argument("--schema-version", type=int)
    g.add_argument("--hash-algo", help="xxh3_128 (default) or sha256")


def make_namespace(args: argparse.Namespace, base: Mapping[str, Any] | None = None) -> Any:
    """A ``kvstore.keys.Namespace`` from ``base`` (a request file's
    "namespace"), then ``--namespace-json``, then the individual flags."""
    fields: dict[str, Any] = {"tenant": "default", "model_id": "default"}
    fields.update(base or {})
    src = getattr(args, "namespace_json", None)
    if src:
        text = src
        if not src.lstrip().startswith("{"):
            try:
                text = Path(src).read_text(encoding="utf-8")
            except OSError as e:
                fail(f"--namespace-json: {src!r} is neither a JSON object nor a readable file: {e}")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"--namespace-json: not valid JSON: {e}")
        if not isinstance(obj, dict):
            fail("--namespace-json: expected a JSON object")
        fields.update(obj)
    for flag, name in _NS_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            fields[name] = value
    return Namespace.from_dict(fields)


def add_daemon_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help=f"daemon address HOST:PORT or unix:PATH (default $KVSTORE_ADDRESS or "
                        f"{DEFAULT_TARGET})")
    p.add_argument("--token-file", help="file holding the bearer token (default $KVSTORE_TOKEN)")


def check_output(path: str, flag: str = "--json") -> None:
    """Refuse, before a long run, an output file the command could not write
    at its end: a directory, or one whose directory is missing or read-only."""
    where = os.path.dirname(path) or "."
    if os.path.isdir(path):
        fail(f"{flag} {path!r} is a directory")
    if not os.path.isdir(where):
        fail(f"{flag} {path!r}: no directory {where!r}")
    if not os.access(where, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        fail(f"{flag} {path!r} is not writable")


def write_json(path: str, data: Any, flag: str = "--json") -> None:
    """Write ``data`` as indented JSON; a failure is a one-line ``CLIError``."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    except OSError as e:
        fail(f"{flag} {path!r} cannot be written: {e.strerror or e}")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v

