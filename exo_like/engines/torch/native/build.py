"""Building and loading the native kernels: torch's extension builder compiles quant.cpp once into a cache
directory named after everything the binary depends on (the source, the flags, the torch version, the CPU kind),
so a restart loads it in milliseconds and a new torch or source builds anew. `make` builds it at install time
(`python -m exo_like.engines.torch.native.build`), so neither the test suite nor a node's first request waits
for the compiler; a node finding no usable build tries once, and without a compiler runs torch's own kernels and
logs why, once."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("quant.cpp", "vnni.cpp", "half.cpp", "rows.cpp", "decode.cpp"))
HEADERS = (Path(__file__).with_name("quant.h"),)  # included by the sources: part of what the binary depends on
# -ffp-contract=off: no product and sum fused where the source did not ask (dequantized rows must match numpy's).
# OpenMP: at::parallel_for runs on torch's own thread team (the loaded libgomp is reused by its soname).
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
DISABLE = "EXO_LIKE_NATIVE"  # set to 0 to run torch's kernels only


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("EXO_LIKE_NATIVE_CACHE", str(Path(base) / "exo-like" / "native")))


def build_key() -> str:
    """What the binary depends on: sources, flags, torch, Python, machine kind; and where torch and the sources
    are, which the build's record names: two checkouts (or environments) sharing one directory rebuilt it
    whenever they took turns (~90 s each)."""
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(repr((FLAGS, LINK_FLAGS, torch.__version__, sys.version_info[:2], platform.machine(),
                        str(Path(torch.__file__).parent), str(SOURCES[0].parent))).encode())
    return digest.hexdigest()[:16]


@functools.cache
def kernels() -> ModuleType | None:
    """The loaded extension, built first if the cache lacks it; None where it cannot be built (logged once)."""
    if os.environ.get(DISABLE, "1") == "0":
        log.info("native CPU kernels turned off (%s=0): quantized matrices run on torch's kernels", DISABLE)
        return None
    key = build_key()
    directory = cache_root() / key
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(directory)
        from torch.utils import cpp_extension

        started = time.monotonic()
        module = cpp_extension.load(name=f"exo_like_quant_{key}", sources=[str(s) for s in SOURCES],
                                    build_directory=str(directory), extra_cflags=list(FLAGS),
                                    extra_ldflags=list(LINK_FLAGS), verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, headers or disk: every cause means the same fallback
        log.warning("no native CPU kernels (%s): quantized matrices run on torch's own kernels", _first_line(exc))
        return None
    elapsed = time.monotonic() - started
    if elapsed > 2:
        log.info("native CPU kernels built in %.0f s into %s", elapsed, directory)
    return module


# torch's builder marks a build in progress with a `lock` file and waits, without limit, while one exists; a process
# killed mid-build leaves it behind, and every later start would wait forever. A build takes minutes.
STALE_LOCK_SECONDS = 15 * 60


def _clear_stale_lock(directory: Path) -> None:
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing a native build lock left %.0f min ago by a process that did not finish: %s",
                    age / 60, lock)
        lock.unlink(missing_ok=True)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


if __name__ == "__main__":  # `make`: build at install time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = kernels()
    print(f"native CPU kernels: {'none' if module is None else module.kernel_name()} ({cache_root() / build_key()})")
    sys.exit(0)
