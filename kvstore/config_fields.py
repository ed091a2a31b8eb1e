"""The field machinery of the config tree (kvstore/config.py), on pydantic:
size and duration parsing and formatting, the annotated field types
(``Size``, ``Duration``, ``SizeList``, ``Port``), the ``Section`` base whose
fields pydantic validates, the translation of pydantic's errors into
:class:`ConfigError` messages that name the dotted key, the value and what
is allowed, and TOML rendering."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import math
import re
import textwrap
from collections.abc import Callable, Mapping
from decimal import Decimal
from enum import Enum
from typing import (
    Annotated,
    Any,
    ClassVar,
    NoReturn,
    get_args,
    get_origin,
    get_type_hints,
)

from annotated_types import Ge, Interval, Le
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
)
from pydantic_core import ErrorDetails, PydanticCustomError
from pydantic_settings import NoDecode

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


class ConfigError(InvalidArgument):
    """A config key is unknown or its value is not allowed. ``key`` is the
    dotted key ("dram.capacity"), or the env var / file it came from."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class FieldKind(Enum):
    """Annotated marker of the fields TOML spells for people."""

    SIZE = "size"
    DURATION = "duration"
    SIZE_LIST = "size_list"


def _as_pydantic(parse: Callable[[Any], Any]) -> BeforeValidator:
    """A pydantic validator from one of our parsers: its InvalidArgument
    becomes a pydantic error that keeps our message."""

    def check(value: Any) -> Any:
        try:
            return parse(value)
        except InvalidArgument as exc:
            raise PydanticCustomError("config_value", "{reason}", {"reason": str(exc)}) from None

    return BeforeValidator(check)


def _size_list(value: Any) -> tuple[int, ...]:
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


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic's lax int/float would take True as 1
        raise PydanticCustomError("bool_not_number", "a boolean is not a number")
    return value


def _enum_text(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


Size = Annotated[int, _as_pydantic(parse_size), FieldKind.SIZE]
"""A byte count; config files and env may spell it "1GiB"."""
Duration = Annotated[float, _as_pydantic(parse_duration), FieldKind.DURATION]
"""Seconds; config files and env may spell it "500ms", "30s", "2m"."""
SizeList = Annotated[tuple[int, ...], _as_pydantic(_size_list), FieldKind.SIZE_LIST, NoDecode]
"""Byte counts, ascending; the empty tuple is spelled "auto"."""
Port = Annotated[int, Interval(ge=0, le=65535)]


def bounds(lo: float | None = None, hi: float | None = None) -> Interval:
    """Annotated metadata: inclusive bounds of an int/size/float field."""
    return Interval(ge=lo, le=hi)


SECTION_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _field_type(hint: Any) -> Any:
    """``hint`` with the validators every config field of its base type gets."""
    base = get_args(hint)[0] if get_origin(hint) is Annotated else hint
    if isinstance(base, type) and issubclass(base, Enum):
        return Annotated[hint, BeforeValidator(_enum_text)]
    if base in (int, float) and FieldKind.SIZE not in getattr(hint, "__metadata__", ()):
        return Annotated[hint, BeforeValidator(_no_bool)]
    return hint


_MODELS: dict[type, type[BaseModel]] = {}


def section_model(cls: type) -> type[BaseModel]:
    """The pydantic model that validates the fields of section dataclass ``cls``."""
    cached = _MODELS.get(cls)
    if cached is not None:
        return cached
    hints = get_type_hints(cls, include_extras=True)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            default: Any = Field(default_factory=f.default_factory)
        else:
            default = f.default
        fields[f.name] = (_field_type(hints[f.name]), default)
    model: type[BaseModel] = create_model(f"{cls.__name__}Fields", __config__=SECTION_MODEL_CONFIG,
                                          **fields)
    _MODELS[cls] = model
    return model


def field_names(cls: type) -> list[str]:
    """The config keys of a section class, in order."""
    return [f.name for f in dataclasses.fields(cls)]


def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring (the string after it)} of section class ``cls``;
    empty strings where the source is unavailable."""
    docs = dict.fromkeys(field_names(cls), "")
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError, IndexError):  # pragma: no cover - frozen/zipped installs
        return docs
    body = node.body if isinstance(node, ast.ClassDef) else []
    for stmt, nxt in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and stmt.target.id in docs and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def field_kind(cls: type, name: str) -> FieldKind | None:
    """The FieldKind marker of field ``name`` of section ``cls``, if any."""
    for item in section_model(cls).model_fields[name].metadata:
        if isinstance(item, FieldKind):
            return item
    return None


class Section:
    """Base of every section (a ``@dataclass(slots=True, frozen=True)``):
    pydantic coerces and validates the fields from their annotations, then
    ``_validate`` checks what spans fields."""

    __slots__ = ()
    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        model = section_model(type(self))
        raw = {name: getattr(self, name) for name in model.model_fields}
        try:
            checked = model.model_validate(raw)
        except ValidationError as exc:
            raise config_error(exc, model, (self.SECTION,)) from None
        for name, value in checked:
            if value is not raw[name]:
                object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        """Checks that span fields; override per section."""

    def _fail(self, name: str, message: str) -> NoReturn:
        key = f"{self.SECTION}.{name}"
        raise ConfigError(f"{key}: {message}", key=key)


def suggest(word: str, choices: list[str]) -> str:
    """" (did you mean 'x'?)" for the closest choice, or ""."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_EXPECTED = {
    "int_parsing": "expected an integer", "int_type": "expected an integer",
    "int_from_float": "expected an integer", "bool_not_number": "expected a number, not a boolean",
    "bool_parsing": "expected true/false (or 1/0, yes/no)", "bool_type": "expected true/false (or 1/0, yes/no)",
    "float_parsing": "expected a finite number", "float_type": "expected a finite number",
    "finite_number": "expected a finite number", "string_type": "expected a string",
}
_BOUND_ERRORS = {"greater_than_equal", "less_than_equal", "greater_than", "less_than"}


def _describe_bounds(metadata: list[Any]) -> str:
    lo = hi = None
    for item in metadata:
        if isinstance(item, (Interval, Ge)) and item.ge is not None:
            lo = item.ge
        if isinstance(item, (Interval, Le)) and item.le is not None:
            hi = item.le
    if lo is not None and hi is not None:
        return f"in {lo:g}..{hi:g}"
    return f">= {lo:g}" if lo is not None else f"<= {hi:g}"


def _nested(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def describe_error(error: ErrorDetails, root: type[BaseModel], prefix: tuple[str, ...] = (),
                   where: str = "") -> tuple[str, str]:
    """(message, dotted key) for one pydantic error below model ``root``,
    in the words of the hand-written loader: the key, the value, what is
    allowed. ``where`` (" in FILE") follows an unknown key's name."""
    model: type[BaseModel] | None = root
    parents: list[str] = list(prefix)
    loc = [str(part) for part in error["loc"]]
    for part in loc[:-1]:  # descend to the model that holds the last part
        field = model.model_fields.get(part) if model is not None else None
        model = _nested(field.annotation) if field is not None else None
        parents.append(part)
    name = loc[-1] if loc else ""
    key = ".".join([*parents, name]) if name else ".".join(parents)
    kind, value = error["type"], error.get("input")
    allowed = list(model.model_fields) if model is not None else []
    if kind == "extra_forbidden":
        if not parents:
            return (f"unknown config section {name!r}{where}{suggest(name, allowed)}; "
                    f"allowed sections: {', '.join(allowed)}"), name
        return (f"unknown config key {key!r}{where}{suggest(name, allowed)}; "
                f"allowed keys in [{parents[-1]}]: {', '.join(allowed)}"), key
    field = model.model_fields.get(name) if model is not None else None
    if field is not None and _nested(field.annotation) is not None:
        return f"config key {key!r}{where}: expected a table [{key}], got {value!r}", key
    if kind == "config_value":
        return f"{key}: {error['msg']}", key
    if kind in _BOUND_ERRORS and field is not None:
        expected = f"expected a value {_describe_bounds(field.metadata)}"
    elif kind == "enum" and field is not None and isinstance(field.annotation, type) \
            and issubclass(field.annotation, Enum):
        expected = "expected one of: " + ", ".join(str(m.value) for m in field.annotation)
    else:
        expected = _EXPECTED.get(kind, error["msg"])
    return f"{key}: invalid value {value!r}: {expected}", key


def config_error(exc: ValidationError, root: type[BaseModel], prefix: tuple[str, ...] = (),
                 origin: Mapping[str, tuple[str, str]] | None = None) -> ConfigError:
    """The ConfigError for the first of pydantic's errors; ``origin`` maps a
    dotted key to (who set it, " in FILE") for the message."""
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    set_by, where = (origin or {}).get(loc, ("", ""))
    message, key = describe_error(first, root, prefix, where)
    if set_by and not (where and where in message):  # " in FILE" said it already
        message += f" (set by {set_by})"
    more = exc.error_count() - 1
    if more:
        message += f" [and {more} more error{'s' if more > 1 else ''}]"
    return ConfigError(message, key=key)


def plain(value: Any) -> Any:
    """JSON-ready form: enums as their value, tuples as lists."""
    return value.value if isinstance(value, Enum) else list(value) if isinstance(value, tuple) \
        else value


def toml_value(kind: FieldKind | None, value: Any) -> str:
    """``value`` spelled in TOML; sizes and durations for people ("1GiB", "30s")."""
    if kind is FieldKind.SIZE:
        text = format_size(value)
        return text if text.isdigit() else toml_str(text)
    if kind is FieldKind.SIZE_LIST:
        if not value:
            return toml_str("auto")
        return "[" + ", ".join(toml_value(FieldKind.SIZE, v) for v in value) + "]"
    if kind is FieldKind.DURATION:
        return toml_str(format_duration(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)) and not isinstance(value, Enum):
        return repr(value)
    return toml_str(str(plain(value)))


_TOML_ESCAPES = {i: f"\\u{i:04x}" for i in [*range(0x20), 0x7F]} | {
    ord('"'): '\\"', ord("\\"): "\\\\", ord("\t"): "\\t", ord("\n"): "\\n", ord("\r"): "\\r"}


def toml_str(text: str) -> str:
    """A TOML basic string."""
    return '"' + text.translate(_TOML_ESCAPES) + '"'
