"""Generate the Python modules for ``proto/kvstore.proto``.

Usage::

    python -m proto.generate          # (re)write proto/kvstore_pb2{.py,.pyi,_grpc.py}
    python -m proto.generate --check  # exit 1 if the checked-in files are stale

``make proto`` runs the first form. The generated files are checked in and
never edited by hand; the only change made to protoc's output is turning the
gRPC module's ``import kvstore_pb2`` into a package-relative import, so that
``import proto.kvstore_pb2_grpc`` works from an installed package.

``--check`` regenerates into a temporary directory and compares. Lines that
only stamp the generator's version are ignored, so a different patch release
of grpcio-tools does not by itself make the files "stale"; any other change
does.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path
from typing import Sequence

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "kvstore.proto"
GENERATED = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")

_GRPC_IMPORT = re.compile(r"^import kvstore_pb2 as kvstore__pb2$", re.MULTILINE)
_GRPC_IMPORT_FIXED = "from . import kvstore_pb2 as kvstore__pb2"

# Lines that name the generator's version and nothing else about the schema.
_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version: .*"
    r"|GRPC_GENERATED_VERSION = .*"
    r"|\s+\d+,\s*$"  # major/minor/patch lines of ValidateProtobufRuntimeVersion(...)
    r")$",
    re.MULTILINE,
)


class GenerateError(RuntimeError):
    """protoc failed or its output was not what this script expects."""


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on kvstore.proto, writing the three modules into ``out_dir``."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise GenerateError(
            "grpcio-tools is not installed; run `.venv/bin/pip install -e '.[test]'`"
        ) from exc
    import importlib.resources

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--proto_path={well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_FILE),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise GenerateError(f"protoc failed (exit {rc}) on {PROTO_FILE}")

    grpc_module = out_dir / "kvstore_pb2_grpc.py"
    text = grpc_module.read_text()
    fixed, count = _GRPC_IMPORT.subn(_GRPC_IMPORT_FIXED, text)
    if count != 1:
        raise GenerateError(
            f"expected one 'import kvstore_pb2 as kvstore__pb2' line in {grpc_module.name}, "
            f"found {count}; grpcio-tools changed its output: update proto/generate.py"
        )
    grpc_module.write_text(fixed)
    return [out_dir / name for name in GENERATED]


def _normalise(text: str) -> str:
    return _VERSION_LINES.sub("<version>", text)


def stale_files(proto_dir: Path = PROTO_DIR) -> dict[str, str]:
    """Regenerate into a temp dir; return {file name: why it is stale} (empty = fresh)."""
    problems: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-proto-") as tmp:
        for fresh in generate(Path(tmp)):
            current = proto_dir / fresh.name
            if not current.exists():
                problems[fresh.name] = "missing"
                continue
            want, have = fresh.read_text(), current.read_text()
            if _normalise(want) == _normalise(have):
                continue
            diff = difflib.unified_diff(
                have.splitlines(), want.splitlines(),
                f"checked-in/{fresh.name}", f"regenerated/{fresh.name}", lineterm="", n=1,
            )
            lines = list(diff)
            shown = "\n".join(lines[:40]) + ("\n..." if len(lines) > 40 else "")
            problems[fresh.name] = "differs from what kvstore.proto generates:\n" + shown
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proto.generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--check", action="store_true",
        help="regenerate into a temp dir and fail if the checked-in files differ",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = stale_files()
            if problems:
                print("generated protobuf modules are stale:", file=sys.stderr)
                for name, why in problems.items():
                    print(f"  proto/{name}: {why}", file=sys.stderr)
                print(
                    "run `python -m proto.generate` (or `make proto`) and commit the result",
                    file=sys.stderr,
                )
                return 1
            print("proto: generated modules are up to date")
            return 0
        written = generate(PROTO_DIR)
    except GenerateError as exc:
        print(f"proto.generate: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
