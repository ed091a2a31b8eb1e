"""Bearer tokens -> principals (kvstore.daemon.auth)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import load_config
from kvstore.daemon.auth import Auth, Principal
from kvstore.errors import InvalidArgument, Unauthenticated

TENANTS = ('[[tenant]]\nname = "acme"\ntoken = "tok-acme"\nshare = 0.5\nrate_limit_rps = 10\n\n'
           '[[tenant]]\nname = "ops"\ntoken = "tok-admin"\nadmin = true\n')


def _md(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_off_without_tokens_everyone_is_admin_without_tenant() -> None:
    a = Auth(load_config(None, {}, {}), env={})
    assert not a.enabled and a.tenants == set()
    assert a.principal([]) == Principal(None, True)
    assert a.principal(_md("anything")) == Principal(None, True)


def test_tenants_file(tmp_path: Path) -> None:
    p = tmp_path / "tenants.toml"
    p.write_text(TENANTS)
    a = Auth(load_config(None, {}, {"server.tenants_file": str(p)}), env={})
    assert a.enabled and a.tenants == {"acme", "ops"}
    assert a.principal(_md("tok-acme")) == Principal("acme", False)
    assert a.principal(_md("tok-admin")) == Principal("ops", True)
    assert a.shares == {"acme": 0.5}
    assert a.rates["acme"].rate_per_s == 10.0
    for md in ([], _md("nope"), [("authorization", "Basic tok-acme")]):
        with pytest.raises(Unauthenticated):
            a.principal(md)


def test_token_file_and_env(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("secret\n")
    a = Auth(load_config(None, {}, {"server.auth_token_file": str(f)}), env={})
    assert a.principal(_md("secret")) == Principal("default", True)
    b = Auth(load_config(None, {}, {"server.auth_token_env": "MY_TOKEN"}), env={"MY_TOKEN": "t2"})
    assert b.principal(_md("t2")) == Principal("default", True)
    with pytest.raises(InvalidArgument):
        Auth(load_config(None, {}, {"server.auth_token_env": "MY_TOKEN"}), env={})
    f.write_text("\n")
    with pytest.raises(InvalidArgument):
        Auth(load_config(None, {}, {"server.auth_token_file": str(f)}), env={})


def test_a_tenant_entry_needs_name_and_token(tmp_path: Path) -> None:
    p = tmp_path / "tenants.toml"
    p.write_text('[[tenant]]\nname = "acme"\n')
    with pytest.raises(InvalidArgument, match="entry 0 needs name and token"):
        Auth(load_config(None, {}, {"server.tenants_file": str(p)}), env={})


def test_a_token_given_to_two_principals_is_refused(tmp_path: Path) -> None:
    """One token, one principal: a second tenant (or the admin token file)
    reusing a token must not silently remap it (acme's clients would act as
    ops, or the admin would lose admin)."""
    p = tmp_path / "tenants.toml"
    p.write_text('[[tenant]]\nname = "acme"\ntoken = "same"\n\n[[tenant]]\nname = "ops"\ntoken = "same"\n')
    with pytest.raises(InvalidArgument, match="entry 1 reuses a token"):
        Auth(load_config(None, {}, {"server.tenants_file": str(p)}), env={})
    f = tmp_path / "token"
    f.write_text("tok-acme\n")
    p.write_text(TENANTS)
    with pytest.raises(InvalidArgument, match="entry 0 reuses a token"):
        Auth(load_config(None, {}, {"server.tenants_file": str(p), "server.auth_token_file": str(f)}), env={})
    # the token file and the env var may name the same admin token
    a = Auth(load_config(None, {}, {"server.auth_token_file": str(f), "server.auth_token_env": "T"}),
             env={"T": "tok-acme"})
    assert a.principal(_md("tok-acme")) == Principal("default", True)


def test_a_tenant_token_is_compared_as_sent_stripped(tmp_path: Path) -> None:
    """``principal`` strips the token a client sends, as it strips the token
    file's: a tenants_file token with surrounding blanks must still match."""
    p = tmp_path / "tenants.toml"
    p.write_text('[[tenant]]\nname = "acme"\ntoken = " tok-acme "\n')
    a = Auth(load_config(None, {}, {"server.tenants_file": str(p)}), env={})
    assert a.principal(_md("tok-acme")) == Principal("acme", False)
    p.write_text('[[tenant]]\nname = "acme"\ntoken = "  "\n')
    with pytest.raises(InvalidArgument, match="entry 0 needs name and token"):
        Auth(load_config(None, {}, {"server.tenants_file": str(p)}), env={})


@pytest.mark.parametrize("text, match", [
    ('[[tenants]]\nname = "acme"\ntoken = "tok-acme"\n', "unknown key"),    # a typo: auth was off
    ("# tenants come later\n", "defines no"),                                # auth was off
    ('tenant = "acme"\n', "must be"),                                        # AttributeError
    ('[[tenant]]\nname = "acme"\ntoken = "t"\nshaer = 0.5\n', "unknown key"),  # share was unset
    ('[[tenant]]\nname = "acme"\ntoken = "t"\nshare = "half"\n', "share = 'half'"),  # ValueError
    ('[[tenant]]\nname = "acme"\ntoken = "t"\nshare = 1.5\n', "share = 1.5"),
    ('[[tenant]]\nname = "acme"\ntoken = "t"\nrate_limit_rps = "fast"\n', "rate_limit_rps"),
    ('[[tenant]]\nname = "acme"\ntoken = "t"\nrate_limit_rps = 0\n', "rate_per_s must be > 0"),
    ('[[tenant\nname = "acme"\n', "not valid TOML"),                         # TOMLDecodeError
], ids=["typo-tenants", "no-tenant", "not-tables", "typo-share", "share-text", "share-over-1",
        "rps-text", "rps-zero", "bad-toml"])
def test_a_tenants_file_that_would_be_ignored_or_crash_is_refused(tmp_path: Path, text: str, match: str) -> None:
    """A tenants file that defines no tenant left auth off (every caller
    admin, tenant from the namespace) while the config said auth was on;
    bad values or TOML raised a bare ValueError/TOMLDecodeError, a traceback
    out of `kvstore serve`. Each is an InvalidArgument (exit 2) naming the file."""
    p = tmp_path / "tenants.toml"
    p.write_text(text)
    with pytest.raises(InvalidArgument, match=match) as exc:
        Auth(load_config(None, {}, {"server.tenants_file": str(p)}), env={})
    assert "server.tenants_file" in str(exc.value)
    with pytest.raises(InvalidArgument, match="cannot be read"):
        Auth(load_config(None, {}, {"server.tenants_file": str(tmp_path / "missing.toml")}), env={})


def test_token_file_one_per_line_and_env_comma_separated(tmp_path: Path) -> None:
    """As config.py documents: server.auth_token_file holds tokens one per
    line, server.auth_token_env's variable comma-separated. Both were read as
    one token ("a\\nb"), which no client can send: nobody authenticated."""
    f = tmp_path / "tokens"
    f.write_text("tok-a\n\n  tok-b  \n")
    a = Auth(load_config(None, {}, {"server.auth_token_file": str(f)}), env={})
    b = Auth(load_config(None, {}, {"server.auth_token_env": "T"}), env={"T": "x1, x2,"})
    for auth, toks in ((a, ("tok-a", "tok-b")), (b, ("x1", "x2"))):
        for tok in toks:
            assert auth.principal(_md(tok)) == Principal("default", True)
        with pytest.raises(Unauthenticated):
            auth.principal(_md(",".join(toks)))
    with pytest.raises(InvalidArgument, match="cannot be read"):
        Auth(load_config(None, {}, {"server.auth_token_file": str(tmp_path / "missing")}), env={})
    with pytest.raises(InvalidArgument, match="unset or empty"):
        Auth(load_config(None, {}, {"server.auth_token_env": "T"}), env={"T": " , "})
