"""Two tenants and an admin, as the tests that check tenant isolation
configure a daemon (auth on): their namespaces and the ``[[tenant]]``
table of tokens."""

from __future__ import annotations

from kvstore.keys import Namespace

ACME = Namespace(tenant="acme", model_id="llama", block_size=16)
BETA = Namespace(tenant="beta", model_id="llama", block_size=16)
TENANTS = ('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\n\n'
           '[[tenant]]\nname = "beta"\ntoken = "tok-beta"\n\n'
           '[[tenant]]\nname = "ops"\ntoken = "tok-admin"\nadmin = true\n')
"""acme and beta, each with its own token, and ops, an admin."""
