"""The field machinery of the config tree (kvstore/config.py): size and
duration parsing and formatting, per-field coercion and validation from type
annotations, TOML rendering, and the ``_Section`` base every section
derives from. Split out of config.py so that module holds only the sections
and the loading layers."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Annotated, Any, Callable, ClassVar, NoReturn, get_args, get_origin, get_type_hints

from kvstore.errors import InvalidArgument

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "ki": KiB, "mi": MiB, "gi": GiB, "ti": TiB,
}

_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[kmgt]i?)?b?\s*$", re.I)
_SIZE_HELP = ('expected a byte count: an integer >= 0 or a string like "1GiB", "512MiB", '
              '"4GB" or "0" (KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000)')
_FORMAT_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB),
                 ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))

_DURATION_UNITS: dict[str, Decimal] = {
    "ns": Decimal("1e-9"), "us": Decimal("1e-6"), "µs": Decimal("1e-6"),
    "ms": Decimal("0.001"), "s": Decimal(1), "": Decimal(1),
    "m": Decimal(60), "h": Decimal(3600), "d": Decimal(86400),
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ns|us|µs|ms|s|m|h|d)?", re.I)
_DURATION_RE = re.compile(r"^(?:\s*(?:\d+(?:\.\d*)?|\.\d+)\s*(?:ns|us|µs|ms|s|m|h|d)?)+\s*$", re.I)
_DURATION_HELP = ('expected a duration >= 0: seconds as a number, or a string like "500ms", '
                  '"30s", "2m", "1h30m" (units ns, us, ms, s, m, h, d)')


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string like "1GiB", "512MiB", "4GB", "0".

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones
    (KB, MB, GB, TB) powers of 1000; case does not matter and the trailing
    "B" is optional ("4k" == 4000, "4Ki" == 4096). Fractions are allowed when
    they come to whole bytes ("1.5GiB"). Raises InvalidArgument otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"invalid size {value!r}: {_SIZE_HELP}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"invalid size {value!r}: {_SIZE_HELP}")
        return value
    match = _SIZE_RE.match(value)
    if match is None:
        raise InvalidArgument(f"invalid size {value!r}: {_SIZE_HELP}")
    total = Decimal(match["num"]) * _SIZE_UNITS[(match["unit"] or "").lower()]
    if total != total.to_integral_value():
        raise InvalidArgument(f"invalid size {value!r}: not a whole number of bytes")
    return int(total)


def format_size(nbytes: int) -> str:
    """The shortest exact spelling of a byte count: "1GiB", "4GB", "1000"."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgument(f"invalid size {nbytes!r}: expected an integer >= 0")
    spellings = [f"{nbytes // mult}{unit}" for unit, mult in _FORMAT_UNITS
                 if nbytes and nbytes % mult == 0]
    return min(spellings + [str(nbytes)], key=len)  # first shortest: binary units win ties


def parse_duration(value: str | float) -> float:
    """Seconds (float) from a number of seconds or a string like "500ms",
    "30s", "2m", "1h30m", "1.5s". Raises InvalidArgument when malformed or
    negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgument(f"invalid duration {value!r}: {_DURATION_HELP}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"invalid duration {value!r}: {_DURATION_HELP}")
        return float(value)
    if not value.strip() or _DURATION_RE.match(value) is None:
        raise InvalidArgument(f"invalid duration {value!r}: {_DURATION_HELP}")
    total = Decimal(0)
    for number, unit in _DURATION_PART.findall(value):
        total += Decimal(number) * _DURATION_UNITS[(unit or "").lower()]
    return float(total)


def format_duration(seconds: float) -> str:
    """A spelling of ``seconds`` that parse_duration reads back exactly:
    "30s", "2m", "1h", "500ms", "1.5s"."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"invalid duration {seconds!r}: expected a finite number >= 0")
    exact = Decimal(repr(float(seconds)))
    candidates = []
    if exact == exact.to_integral_value():
        whole = int(exact)
        if whole and whole % 3600 == 0:
            candidates.append(f"{whole // 3600}h")
        if whole and whole % 60 == 0:
            candidates.append(f"{whole // 60}m")
        candidates.append(f"{whole}s")
    millis = exact * 1000
    if millis == millis.to_integral_value():
        candidates.append(f"{int(millis)}ms")
    candidates.append(f"{format(exact.normalize(), 'f')}s")
    for text in candidates:
        if parse_duration(text) == float(seconds):
            return text
    return f"{format(exact, 'f')}s"  # pragma: no cover - the last candidate is exact


class _Kind(Enum):
    STR, INT, FLOAT, BOOL, SIZE, DURATION, SIZE_LIST, ENUM = range(8)


@dataclass(slots=True, frozen=True)
class _Range:
    """Annotated metadata: inclusive bounds for an int/size/float field."""

    lo: float | None = None
    hi: float | None = None

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {self.lo:g}..{self.hi:g}"
        return f">= {self.lo:g}" if self.lo is not None else f"<= {self.hi:g}"


Size = Annotated[int, _Kind.SIZE]
"""A byte count; config files and env may spell it "1GiB"."""
Duration = Annotated[float, _Kind.DURATION]
"""Seconds; config files and env may spell it "500ms", "30s", "2m"."""
SizeList = Annotated[tuple[int, ...], _Kind.SIZE_LIST]
"""Byte counts, ascending; the empty tuple is spelled "auto"."""
Port = Annotated[int, _Range(0, 65535)]


class ConfigError(InvalidArgument):
    """A config key is unknown or its value is not allowed. ``key`` is the
    dotted key ("dram.capacity"), or the env var / file it came from."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


@dataclass(slots=True, frozen=True)
class _FieldSpec:
    name: str
    kind: _Kind
    enum: type[Enum] | None = None
    bounds: _Range | None = None


def _spec_of(name: str, hint: Any) -> _FieldSpec:
    kind: _Kind | None = None
    bounds: _Range | None = None
    base = hint
    if get_origin(hint) is Annotated:
        base, *meta = get_args(hint)
        for item in meta:
            if isinstance(item, _Kind):
                kind = item
            elif isinstance(item, _Range):
                bounds = item
    if kind is None:
        if isinstance(base, type) and issubclass(base, Enum):
            return _FieldSpec(name, _Kind.ENUM, enum=base)
        simple = {str: _Kind.STR, bool: _Kind.BOOL, int: _Kind.INT, float: _Kind.FLOAT}
        if base not in simple:
            raise TypeError(f"config field {name!r}: unsupported type {hint!r}")
        kind = simple[base]
    return _FieldSpec(name, kind, bounds=bounds)


_SPECS: dict[type, dict[str, _FieldSpec]] = {}


def _specs(cls: type) -> dict[str, _FieldSpec]:
    specs = _SPECS.get(cls)
    if specs is None:
        hints = get_type_hints(cls, include_extras=True)
        specs = {f.name: _spec_of(f.name, hints[f.name]) for f in dataclasses.fields(cls)}
        _SPECS[cls] = specs
    return specs


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_INT_RE = re.compile(r"^\s*[+-]?\d[\d_]*\s*$")


def _bad(key: str, value: Any, expected: str) -> NoReturn:
    raise ConfigError(f"{key}: invalid value {value!r}: {expected}", key=key)


def _as_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("expected a string")


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else ""
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError("expected true/false (or 1/0, yes/no)")


def _as_int(value: Any) -> int:
    if isinstance(value, str) and _INT_RE.match(value):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError("expected an integer")


def _as_float(value: Any) -> float:
    try:
        if not isinstance(value, bool) and isinstance(value, (int, float, str)) \
                and math.isfinite(number := float(value)):
            return number
    except ValueError:
        pass
    raise ValueError("expected a finite number")


def _coerce(spec: _FieldSpec, value: Any, key: str) -> Any:
    """The typed value of ``value`` for field ``spec``; raises ConfigError."""
    try:
        if spec.enum is not None:
            result: Any = _coerce_enum(spec.enum, value)
        else:
            result = _PARSERS[spec.kind](value)
    except InvalidArgument as exc:  # parse_size & co. name the value already
        raise ConfigError(f"{key}: {exc}", key=key) from None
    except ValueError as exc:
        _bad(key, value, str(exc))
    bounds = spec.bounds
    if bounds is not None and not ((bounds.lo is None or result >= bounds.lo)
                                   and (bounds.hi is None or result <= bounds.hi)):
        _bad(key, value, f"expected a value {bounds.describe()}")
    return result


def _coerce_size_list(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return ()
        items: list[Any] = [part.strip() for part in value.split(",") if part.strip()]
        if not items:
            raise InvalidArgument(f'invalid size list {value!r}: expected "auto" or sizes '
                                  'separated by commas, e.g. "64KiB,1MiB"')
    elif isinstance(value, (list, tuple)):
        items = list(value)
        if not items:
            return ()
    else:
        raise InvalidArgument(f'invalid size list {value!r}: expected "auto" or a list of sizes')
    sizes = sorted({parse_size(item) for item in items})
    if len(sizes) != len(items) or sizes[0] == 0:
        raise InvalidArgument(f"invalid size list {value!r}: sizes must be > 0 and distinct")
    return tuple(sizes)


def _coerce_enum(enum: type[Enum], value: Any) -> Enum:
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        for member in enum:
            if str(member.value).lower() == value.strip().lower():
                return member
    raise ValueError("expected one of: " + ", ".join(str(m.value) for m in enum))


_PARSERS: dict[_Kind, Callable[[Any], Any]] = {
    _Kind.STR: _as_str, _Kind.BOOL: _as_bool, _Kind.INT: _as_int, _Kind.FLOAT: _as_float,
    _Kind.SIZE: parse_size, _Kind.DURATION: parse_duration, _Kind.SIZE_LIST: _coerce_size_list,
}


def _plain(value: Any) -> Any:
    """JSON-ready form: enums as their value, tuples as lists."""
    return value.value if isinstance(value, Enum) else list(value) if isinstance(value, tuple) \
        else value


def _toml_value(spec: _FieldSpec, value: Any) -> str:
    if spec.kind is _Kind.SIZE:
        text = format_size(value)
        return text if text.isdigit() else _toml_str(text)
    if spec.kind is _Kind.SIZE_LIST:
        if not value:
            return _toml_str("auto")
        return "[" + ", ".join(_toml_value(_FieldSpec("", _Kind.SIZE), v) for v in value) + "]"
    if spec.kind is _Kind.DURATION:
        return _toml_str(format_duration(value))
    if spec.kind is _Kind.BOOL:
        return "true" if value else "false"
    if spec.kind in (_Kind.INT, _Kind.FLOAT):
        return repr(value)
    return _toml_str(str(_plain(value)))


_TOML_ESCAPES = {i: f"\\u{i:04x}" for i in [*range(0x20), 0x7F]} | {
    ord('"'): '\\"', ord("\\"): "\\\\", ord("\t"): "\\t", ord("\n"): "\\n", ord("\r"): "\\r"}


def _toml_str(text: str) -> str:
    return '"' + text.translate(_TOML_ESCAPES) + '"'


class _Section:
    """Base of every section: coerces and validates fields from annotations."""

    __slots__ = ()
    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for spec in _specs(type(self)).values():
            raw = getattr(self, spec.name)
            value = _coerce(spec, raw, f"{self.SECTION}.{spec.name}")
            if value is not raw:
                object.__setattr__(self, spec.name, value)
        self._validate()

    def _validate(self) -> None:
        """Checks that span fields; override per section."""

    def _fail(self, name: str, message: str) -> NoReturn:
        key = f"{self.SECTION}.{name}"
        raise ConfigError(f"{key}: {message}", key=key)
