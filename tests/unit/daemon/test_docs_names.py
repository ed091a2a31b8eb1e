"""The docs name only settings, variables, metrics and flags that exist: every
``KVSTORE_*`` variable, dotted config key and daemon or router metric that
README.md and docs/*.md mention is checked against the code, so are the
config table's flags, variables and defaults in docs/operations.md, and
every ``kvstore`` command line and flag the pages show."""

from __future__ import annotations

import re
from pathlib import Path

from kvstore.config import Config
from kvstore.config_sources import ENV_ALLOWLIST
from kvstore.daemon.metrics import Metrics

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
DAEMON_DOCS = ("operations.md", "daemon.md", "cluster.md", "admission.md", "security.md", "reliability.md",
               "ssd.md", "hbm.md", "architecture.md", "README.md")
"""Pages whose ``kvstore_*`` names are the daemon's metrics (the others name
the router's, the engine connector's or benchmark figures)."""
_SUFFIXES = ("_bucket", "_count", "_sum", "_created", "_total", "_info")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _py_sources() -> str:
    dirs = ("kvstore", "tiers", "transport", "admission", "router", "engine_adapter", "bench", "tests")
    return "\n".join(p.read_text(encoding="utf-8") for d in dirs for p in (ROOT / d).rglob("*.py"))


def _families(names: set[str]) -> set[str]:
    """Sample names and the family names they come from."""
    out = set(names)
    for n in names:
        for s in _SUFFIXES:
            if n.endswith(s):
                out.add(n[: -len(s)])
    return out


def test_every_kvstore_variable_in_the_docs_exists() -> None:
    config_vars = {"KVSTORE_" + k.replace(".", "_").upper() for k in Config.keys()} | ENV_ALLOWLIST
    sources = _py_sources()
    missing = []
    for page in DOCS:
        for var in sorted(set(re.findall(r"\bKVSTORE_[A-Z0-9_]*[A-Z0-9]\b", _text(page)))):
            if var in config_vars or f'"{var}"' in sources or f"'{var}'" in sources:
                continue
            knob = var.removeprefix("KVSTORE_FAULT_").lower()  # tests/faults/faultlib.py setting("knob", ...)
            if var.startswith("KVSTORE_FAULT_") and f'setting("{knob}"' in sources:
                continue
            missing.append(f"{page.name}: {var}")
    assert missing == []


def test_every_config_key_in_the_docs_exists() -> None:
    keys = set(Config.keys())
    sections = "|".join(sorted({k.split(".")[0] for k in keys}))
    missing = [f"{page.name}: {key}" for page in DOCS
               for key in sorted(set(re.findall(rf"`((?:{sections})\.[a-z_]*[a-z])`", _text(page))))
               if key not in keys]
    assert missing == []


def test_every_daemon_metric_in_the_docs_is_exported() -> None:
    exported = _families(Metrics(lambda: None).names())  # type: ignore[arg-type, return-value]
    missing = [f"{page.name}: {name}" for page in DOCS if page.name in DAEMON_DOCS
               for name in sorted(set(re.findall(r"\bkvstore_[a-z0-9_]*[a-z0-9]\b", _text(page))))
               if not name.startswith("kvstore_route_") and name not in exported]
    assert missing == []


def test_every_daemon_metric_is_documented() -> None:
    text = "".join(_text(page) for page in DOCS)
    names = {n for n in Metrics(lambda: None).names()  # type: ignore[arg-type, return-value]
             if not n.endswith(("_created", "_bucket", "_count", "_sum"))}
    assert sorted(n for n in names if n.removesuffix("_total") not in text) == []


def test_every_router_metric_in_the_docs_is_exported() -> None:
    source = (ROOT / "router" / "metrics.py").read_text(encoding="utf-8")
    defined = _families(set(re.findall(r'"(kvstore_route_[a-z0-9_]+)"', source)))
    defined |= {n + "_total" for n in defined}  # a Counter named without _total exposes it
    missing = [f"{page.name}: {name}" for page in DOCS
               for name in sorted(set(re.findall(r"\bkvstore_route_[a-z0-9_]*[a-z0-9]\b", _text(page))))
               if name not in defined]
    assert missing == []


def test_operations_config_table_matches_the_settings() -> None:
    """Each row of docs/operations.md's key table: the flag sets that key, the
    variable is the key's, and the default is the settings model's."""
    from kvstore.config import load_config, parse_duration, parse_size
    from kvstore.tools.commands import SERVE_FLAGS

    flags = {"--" + dest.replace("_", "-"): key for dest, key in SERVE_FLAGS.items()}
    defaults = load_config(None, {}, {}).to_dict()
    rows = re.findall(r"^\|\s*`([a-z_]+\.[a-z_]+)`(?:, `[^`]+`)?\s*\|([^|]*)\|([^|]*)\|([^|]*)\|",
                      _text(ROOT / "docs" / "operations.md"), re.M)
    assert len(rows) >= 20
    wrong = []
    for key, flag, env, doc in rows:
        flag, env, doc = flag.strip().strip("`"), env.strip().strip("`"), doc.strip()
        section, name = key.split(".")
        value = defaults[section][name]
        if flag and flags.get(flag) != key or not flag and key in SERVE_FLAGS.values():
            wrong.append(f"{key}: flag {flag!r}")
        if env and "*" not in env and env != "KVSTORE_" + key.replace(".", "_").upper():
            wrong.append(f"{key}: env {env!r}")
        shown = doc.split("`")[1] if doc.startswith("`") else doc
        if value == "":
            ok = doc == "(none)" or shown.startswith(("$", "<"))  # none, or derived at start
        elif isinstance(value, bool):
            ok = shown == str(value).lower()
        elif isinstance(value, int):
            ok = parse_size(shown) == value
        elif isinstance(value, float):
            ok = parse_duration(shown) == value
        else:
            ok = shown == str(value)
        if not ok:
            wrong.append(f"{key}: documented default {doc!r}, settings {value!r}")
    assert wrong == []


def test_every_kvstore_command_and_flag_in_the_docs_is_accepted() -> None:
    """Command lines in code blocks parse as written; every ``--flag`` named
    after ``kvstore SUBCOMMAND`` (synopses included) is one that subcommand takes."""
    import argparse
    import shlex

    from kvstore.tools.cli import build_parser

    def options(p: argparse.ArgumentParser) -> set[str]:
        out: set[str] = set()
        for a in p._actions:
            out |= set(a.option_strings)
            if isinstance(a, argparse._SubParsersAction):
                for q in a.choices.values():
                    out |= options(q)
        return out

    ap = build_parser()
    subs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    bad = []
    for page in DOCS:
        text = _text(page)
        for m in re.finditer(rf"(?<![\w/-])kvstore ({'|'.join(subs)})\b([^\n`]*)", text):
            bad += [f"{page.name}: kvstore {m[1]} {f}" for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m[2])
                    if f not in options(subs[m[1]])]
        for block in re.findall(r"^ *```(?:sh)?\n(.*?)^ *```", text, re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                cmd = re.match(r"^(?:\$ )?(?:\S*/)?kvstore ((?:serve|stats|lookup|diff|capacity|admin|route)\b.*)", line)
                if cmd is None or "[" in cmd[1] or "..." in cmd[1] or "(up " in cmd[1]:
                    continue  # synopses and the stats header are not command lines
                argv = shlex.split(re.split(r" #| \| | > | &", cmd[1])[0])
                try:
                    ap.parse_args(argv)
                except SystemExit:
                    bad.append(f"{page.name}: {line.strip()}")
    assert bad == []
