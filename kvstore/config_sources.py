"""The loading layers of the config tree (kvstore/config.py) on
pydantic-settings: defaults < a TOML file (``TomlConfigSettingsSource``) <
``KVSTORE_<SECTION>_<FIELD>`` environment variables (``EnvSettingsSource``
with nested names) < dotted overrides (the init arguments).

pydantic-settings skips unknown variables and missing files; this module
keeps the stricter rules of the daemon: an unknown ``KVSTORE_*`` variable is
an error unless allow-listed (or named by ``server.auth_token_env``), a
missing or broken file is an error, and every error says where the value
came from."""

from __future__ import annotations

import contextvars
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel, Field, ValidationError, create_model
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from kvstore.config_fields import (
    ConfigError,
    config_error,
    field_names,
    section_model,
    suggest,
)

ENV_PREFIX = "KVSTORE_"
ENV_ALLOWLIST = frozenset({
    "KVSTORE_CONFIG",   # path of the config file (when load_config gets none)
    "KVSTORE_ADDRESS",  # daemon address, read by the client and CLI
    "KVSTORE_TOKEN",    # bearer token, read by the client and CLI
})
"""``KVSTORE_*`` variables that are not config keys and are never an error.
The variable named by ``server.auth_token_env`` is skipped as well."""

Sections = Mapping[str, type]
"""{section name: its Section dataclass}, in tree order."""
Origin = dict[str, tuple[str, str]]
"""dotted key (or section) -> (who set it, " in <where>") for error messages."""

_LAYERS: contextvars.ContextVar[tuple[PydanticBaseSettingsSource, ...]] = \
    contextvars.ContextVar("kvstore_config_layers", default=())


class SettingsBase(BaseSettings):
    """Base of the generated settings model (one field per section): merges
    the layers of one :func:`load_layers` call, first source wins."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="_", env_nested_max_split=1,
        case_sensitive=False, extra="forbid", frozen=True)

    @classmethod
    def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, *_LAYERS.get())


def settings_class(sections: Sections) -> type[SettingsBase]:
    """The settings model of a section tree: each section's pydantic model
    as a field, defaulting to that section's defaults."""
    fields: dict[str, Any] = {
        name: (section_model(cls), Field(default_factory=section_model(cls)))
        for name, cls in sections.items()}
    model: type[SettingsBase] = create_model("KvstoreSettings", __base__=SettingsBase, **fields)
    return model


def unknown_section(key: str, where: str, sections: Sections) -> NoReturn:
    allowed = list(sections)
    raise ConfigError(
        f"unknown config section {key!r}{where}{suggest(key, allowed)}; "
        f"allowed sections: {', '.join(allowed)}", key=key)


def split_key(key: str, where: str, sections: Sections) -> tuple[str, str]:
    """(section, field) of a dotted key; ConfigError when it names no key."""
    section, dot, name = key.partition(".")
    if not dot or not name or "." in name:
        raise ConfigError(f"config key {key!r}{where}: expected 'section.field', e.g. "
                          "'dram.capacity'", key=key)
    if section not in sections:
        unknown_section(section, where, sections)
    allowed = field_names(sections[section])
    if name not in allowed:
        raise ConfigError(
            f"unknown config key {key!r}{where}{suggest(name, allowed)}; "
            f"allowed keys in [{section}]: {', '.join(allowed)}", key=key)
    return section, name


def validate_tree(settings: type[SettingsBase], values: Mapping[str, Any], origin: Origin) -> BaseModel:
    """``values`` ({section: {field: raw}}) validated, without the layers."""
    try:
        return settings.model_validate(values)
    except ValidationError as exc:
        raise config_error(exc, settings, origin=origin) from None


def _toml_source(settings: type[SettingsBase], path: str | os.PathLike[str],
                 origin: Origin) -> TomlConfigSettingsSource:
    """The TOML layer; a missing or broken file is an error (pydantic-settings
    would skip a missing one)."""
    name = os.fspath(path)
    if not os.path.exists(name):
        raise ConfigError(f"config file {name!r} not found")
    if not os.path.isfile(name):
        raise ConfigError(f"config file {name!r} cannot be read: not a regular file")
    try:
        source = TomlConfigSettingsSource(settings, toml_file=Path(name))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {name!r} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise ConfigError(f"config file {name!r} is not valid TOML: not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"config file {name!r} cannot be read: {exc}") from None
    for section, table in source.toml_data.items():
        if section in settings.model_fields and not isinstance(table, dict):  # else a flag or variable
            # setting a key of the section would replace it in the merge, without a word
            raise ConfigError(f"config key {section!r} in {name}: expected a table [{section}], got {table!r}")
        origin[section] = (f"config file {name}", f" in {name}")
        for key in table if isinstance(table, dict) else ():
            origin[f"{section}.{key}"] = origin[section]
    return source


def env_key(var: str, sections: Sections) -> tuple[str, str] | ConfigError:
    """(section, field) for a KVSTORE_* variable, or the error to raise."""
    rest = var[len(ENV_PREFIX):]
    for section in sorted(sections, key=len, reverse=True):
        prefix = section.upper() + "_"
        if rest.startswith(prefix):
            name = rest[len(prefix):].lower()
            fields_ = field_names(sections[section])
            if name in fields_:
                return section, name
            allowed = ", ".join(f"{ENV_PREFIX}{section.upper()}_{f.upper()}" for f in fields_)
            return ConfigError(
                f"unknown environment variable {var}: {section}.{name} is not a config key"
                f"{suggest(name, fields_)}; allowed in [{section}]: {allowed}", key=var)
    names = ", ".join(s.upper() for s in sections)
    return ConfigError(
        f"unknown environment variable {var}: expected {ENV_PREFIX}<SECTION>_<FIELD> with "
        f"SECTION one of {names}, or one of {', '.join(sorted(ENV_ALLOWLIST))}", key=var)


def _env_source(settings: type[SettingsBase], environ: Mapping[str, str], token_env: Any,
                origin: Origin, sections: Sections) -> EnvSettingsSource:
    """The env layer over the known ``KVSTORE_*`` variables only: any other
    is an error, except the allow-list and the token variable."""
    known: dict[str, str] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in ENV_ALLOWLIST:
            continue
        found = env_key(var, sections)
        if isinstance(found, ConfigError):
            if var != token_env:  # the token variable is not a config key
                raise found
            continue
        known[var.lower()] = environ[var]
        origin[".".join(found)] = (f"environment variable {var}", f" in environment variable {var}")
    source = EnvSettingsSource(settings)
    source.env_vars = known  # read this mapping, not os.environ
    return source


def load_layers(settings: type[SettingsBase], sections: Sections, path: str | os.PathLike[str] | None,
                environ: Mapping[str, str], overrides: Mapping[str, Any]) -> tuple[BaseModel, Origin]:
    """The validated settings from the layers, and where each key was set."""
    origin: Origin = {}
    layers: list[PydanticBaseSettingsSource] = []
    toml_server: Any = {}
    if path is not None:
        toml = _toml_source(settings, path, origin)
        toml_server = toml.toml_data.get("server", {})
        layers.append(toml)

    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if value is None:  # a flag that was not given
            continue
        section, name = split_key(key, " in overrides", sections)
        nested.setdefault(section, {})[name] = value
        origin[key] = (f"override {key}", " in overrides")

    # the variable server.auth_token_env names holds tokens: find it before the env layer
    token_env = toml_server.get("auth_token_env", "") if isinstance(toml_server, dict) else ""
    token_env = environ.get(f"{ENV_PREFIX}SERVER_AUTH_TOKEN_ENV", token_env)
    token_env = nested.get("server", {}).get("auth_token_env", token_env)
    layers.insert(0, _env_source(settings, environ, token_env, origin, sections))

    reset = _LAYERS.set(tuple(layers))
    try:
        return settings(**nested), origin
    except ValidationError as exc:
        raise config_error(exc, settings, origin=origin) from None
    except SettingsError as exc:
        raise ConfigError(f"config: {exc}") from None
    finally:
        _LAYERS.reset(reset)
