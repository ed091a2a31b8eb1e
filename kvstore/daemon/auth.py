"""Who is calling: bearer tokens -> principals (tenant, admin), and the
per-tenant settings of ``server.tenants_file`` (tier shares, Admit rate limits)."""

from __future__ import annotations

import hmac
import math
import os
import tomllib
from dataclasses import dataclass
from typing import Any

from admission.quota import RateLimit
from kvstore.config import Config
from kvstore.errors import InvalidArgument, Unauthenticated


@dataclass(slots=True, frozen=True)
class Principal:
    tenant: str | None  # None: auth is off, the namespace names the tenant
    admin: bool


class Auth:
    """Bearer tokens -> principals. Off when no token is configured.

    Sources: ``server.auth_token_file`` (tokens one per line, full access,
    tenant "default"), the env var named by ``server.auth_token_env`` (same,
    comma-separated), and
    ``server.tenants_file``: TOML ``[[tenant]] name = "acme" token = "..."
    admin = false``, optionally ``share = 0.5`` (of each tier: over it, the
    tenant's blocks are evicted first) and ``rate_limit_rps = 100`` (Admit).
    """

    def __init__(self, cfg: Config, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self._tokens: dict[str, Principal] = {}
        self.shares: dict[str, float] = {}
        """tenant -> share of each tier (tenants_file ``share``)."""
        self.rates: dict[str, RateLimit] = {}
        """tenant -> Admit rate limit (tenants_file ``rate_limit_rps``)."""
        s = cfg.server
        if s.auth_token_file:  # tokens one per line
            try:
                with open(s.auth_token_file) as f:
                    toks = [line.strip() for line in f.read().splitlines() if line.strip()]
            except OSError as e:
                raise InvalidArgument(f"server.auth_token_file {s.auth_token_file} cannot be read: "
                                      f"{e.strerror or e}") from None
            if not toks:
                raise InvalidArgument(f"server.auth_token_file {s.auth_token_file} is empty")
            for tok in toks:
                self._add(tok, Principal("default", True), "server.auth_token_file")
        if s.auth_token_env:  # tokens comma-separated
            toks = [t.strip() for t in env.get(s.auth_token_env, "").split(",") if t.strip()]
            if not toks:
                raise InvalidArgument(f"server.auth_token_env names {s.auth_token_env}, which is unset or empty")
            for tok in toks:
                self._add(tok, Principal("default", True), "server.auth_token_env")
        if s.tenants_file:
            for i, t in enumerate(_tenant_entries(s.tenants_file)):
                name, tok = t.get("name"), str(t.get("token") or "").strip()
                if not name or not tok:
                    raise InvalidArgument(f"tenants_file entry {i} needs name and token")
                where = f"server.tenants_file {s.tenants_file}: entry {i} ({name})"
                self._add(tok, Principal(str(name), bool(t.get("admin", False))), f"tenants_file entry {i}")
                if "share" in t:
                    self.shares[str(name)] = _number(t, "share", where, 0.0, 1.0)
                if "rate_limit_rps" in t:
                    rps = _number(t, "rate_limit_rps", where, 0.0, None)
                    burst = _number(t, "rate_limit_burst", where, 1.0, None) if "rate_limit_burst" in t \
                        else max(1.0, rps)
                    try:
                        self.rates[str(name)] = RateLimit(rps, burst)
                    except InvalidArgument as e:
                        raise InvalidArgument(f"{where}: {e}") from None

    def _add(self, tok: str, who: Principal, source: str) -> None:
        """Map a token (as ``principal`` compares it: stripped) to ``who``; a
        token already mapped to someone else is refused (one token, one
        principal: the later entry would silently take the earlier's place)."""
        had = self._tokens.get(tok)
        if had is not None and had != who:
            raise InvalidArgument(f"{source} reuses a token already given to tenant {had.tenant!r} "
                                  f"(admin={had.admin}): every token must be distinct")
        self._tokens[tok] = who

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @property
    def tenants(self) -> set[str]:
        return {p.tenant for p in self._tokens.values() if p.tenant is not None}

    def principal(self, metadata: Any) -> Principal:
        if not self._tokens:
            return Principal(None, True)
        header = ""
        for k, v in metadata or ():
            if k == "authorization":
                header = v
        if not header.startswith("Bearer "):
            raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer <token>')")
        given = header[7:].strip().encode()
        for tok, p in self._tokens.items():
            if hmac.compare_digest(tok.encode(), given):
                return p
        raise Unauthenticated("unknown token")


_TENANT_KEYS = ("name", "token", "admin", "share", "rate_limit_rps", "rate_limit_burst")


def _tenant_entries(path: str) -> list[dict[str, Any]]:
    """The ``[[tenant]]`` tables of ``server.tenants_file``. A file that
    cannot be read or parsed, a key other than ``tenant`` (``[[tenants]]``),
    an entry key that is not known, or no tenant at all is refused: each
    would leave auth off, or a tenant's share or rate limit unset, without a
    word."""
    where = f"server.tenants_file {path}"
    try:
        with open(path, "rb") as fb:
            doc = tomllib.load(fb)
    except OSError as e:
        raise InvalidArgument(f"{where} cannot be read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"{where} is not valid TOML: {e}") from None
    unknown = sorted(set(doc) - {"tenant"})
    if unknown:
        raise InvalidArgument(f"{where}: unknown key(s) {', '.join(unknown)}; expected [[tenant]] tables")
    entries = doc.get("tenant", [])
    if not isinstance(entries, list) or not all(isinstance(t, dict) for t in entries):
        raise InvalidArgument(f"{where}: 'tenant' must be [[tenant]] tables")
    if not entries:
        raise InvalidArgument(f"{where} defines no [[tenant]]: auth would be off")
    for i, t in enumerate(entries):
        bad = sorted(set(t) - set(_TENANT_KEYS))
        if bad:
            raise InvalidArgument(f"{where}: entry {i} has unknown key(s) {', '.join(bad)}; "
                                  f"allowed: {', '.join(_TENANT_KEYS)}")
    return entries


def _number(entry: dict[str, Any], key: str, where: str, lo: float, hi: float | None) -> float:
    """``entry[key]`` as a float in ``lo..hi``, else InvalidArgument naming it."""
    value = entry[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < lo or (hi is not None and value > hi):
        allowed = f"a number in {lo:g}..{hi:g}" if hi is not None else f"a number >= {lo:g}"
        raise InvalidArgument(f"{where}: {key} = {value!r}: expected {allowed}")
    return float(value)
