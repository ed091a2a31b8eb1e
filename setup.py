"""Declares the optional C extension ``kvstore._native``; nothing else.

All project metadata lives in ``pyproject.toml``.  The extension is built
with ``optional=True``: when no compiler or no Python headers are available
the build prints a warning and the install still succeeds, and
``kvstore.keys`` / ``kvstore.checksum`` use their pure-Python fallbacks
(which compute the same values). ``kvstore.core.ckeytable`` (the block index's key
table) is optional the same way (numpy fallback in ``kvstore/core/keytable.py``).

The vendored xxHash (``kvstore/_vendor/xxhash``) is ``#include``d by
``_native.c``; on x86 its kernels are compiled for SSE2, AVX2 and AVX-512
side by side and picked at load time (``xxh_x86dispatch``), so no
``-march`` flag is used and the binary runs on any x86-64.
"""

from __future__ import annotations

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_VENDOR = "kvstore/_vendor/xxhash"


class _BuildExt(build_ext):
    """Adds optimisation flags for gcc/clang-style compilers only."""

    def build_extensions(self) -> None:
        if self.compiler.compiler_type in ("unix", "mingw32", "cygwin"):
            for ext in self.extensions:
                ext.extra_compile_args = [
                    *ext.extra_compile_args,
                    "-O3",
                    "-fvisibility=hidden",
                ]
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            name="kvstore._native",
            sources=["kvstore/_native.c"],
            depends=[
                f"{_VENDOR}/xxhash.h",
                f"{_VENDOR}/xxh_x86dispatch.c",
                f"{_VENDOR}/xxh_x86dispatch.h",
            ],
            optional=True,
        ),
        Extension(name="kvstore.core.ckeytable", sources=["kvstore/core/ckeytable.c"], optional=True),
    ],
    cmdclass={"build_ext": _BuildExt},
)
