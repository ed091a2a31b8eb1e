"""Who is calling: bearer tokens -> principals (tenant, admin), and the
per-tenant settings of ``server.tenants_file`` (tier shares, Admit rate limits)."""

from __future__ import annotations

import hmac
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

    Sources: ``server.auth_token_file`` (one token, full access, tenant
    "default"), the env var named by ``server.auth_token_env`` (same), and
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
        if s.auth_token_file:
            with open(s.auth_token_file) as f:
                tok = f.read().strip()
            if not tok:
                raise InvalidArgument(f"server.auth_token_file {s.auth_token_file} is empty")
            self._add(tok, Principal("default", True), "server.auth_token_file")
        if s.auth_token_env:
            tok = env.get(s.auth_token_env, "").strip()
            if not tok:
                raise InvalidArgument(f"server.auth_token_env names {s.auth_token_env}, which is unset or empty")
            self._add(tok, Principal("default", True), "server.auth_token_env")
        if s.tenants_file:
            with open(s.tenants_file, "rb") as fb:
                doc = tomllib.load(fb)
            for i, t in enumerate(doc.get("tenant", [])):
                name, tok = t.get("name"), str(t.get("token") or "").strip()
                if not name or not tok:
                    raise InvalidArgument(f"tenants_file entry {i} needs name and token")
                self._add(tok, Principal(str(name), bool(t.get("admin", False))), f"tenants_file entry {i}")
                if "share" in t:
                    self.shares[str(name)] = float(t["share"])
                if "rate_limit_rps" in t:
                    self.rates[str(name)] = RateLimit(float(t["rate_limit_rps"]),
                                                      float(t.get("rate_limit_burst", max(1.0, t["rate_limit_rps"]))))

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
