"""The C++ extension (ops.cpp, kv_copy.cpp), built once per source, torch version and CPU.

torch.utils.cpp_extension compiles it with -O3 -march=native into
~/.cache/pdmesh/ext/ (PDMESH_EXT_DIR), keyed by a digest of the source, the torch version
and this CPU's flags, so a copy built on another processor is never loaded. `make venv`
builds it (`python -m kernels.cpu_ops`); a process that finds no build compiles it then
(~1 min on 2 cores; concurrent processes wait on torch's lock in that folder). No compiler,
or PDMESH_CPU_EXT=0: load() returns None and the callers use the torch reference.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("pdmesh.kernels")
SOURCE = Path(__file__).with_name("ops.cpp")
SOURCES = (SOURCE, Path(__file__).with_name("kv_copy.cpp"))
_cache: dict[str, object] = {}
_lock = threading.Lock()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def build_dir() -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + Path(__file__).read_bytes()
                            + torch.__version__.encode()
                            + _cpu_flags().encode()).hexdigest()[:16]
    root = Path(os.environ.get("PDMESH_EXT_DIR", Path.home() / ".cache" / "pdmesh" / "ext"))
    return root / f"cpu_ops-{digest}"


def enabled() -> bool:
    return os.environ.get("PDMESH_CPU_EXT", "1") not in ("0", "false", "no")


def load():
    """The compiled module (quant_rows, dequant_rows, paged_decode, slots_decode,
    kv_gather, kv_scatter), or None
    (off, or the build failed: logged once). Built or loaded once per process, whichever
    thread asks first (the engine's step thread, the KV wire's workers)."""
    if "mod" not in _cache:
        with _lock:
            if "mod" not in _cache:
                _cache["mod"] = _build() if enabled() else None
    return _cache["mod"]


def _build():
    import sys

    from torch.utils import cpp_extension

    # ninja comes with the venv (requirements.txt): found on PATH by cpp_extension
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    fresh = not any(out.glob("*.so"))
    if fresh:
        log.info("building the C++ CPU ops in %s (once)", out)
    try:
        mod = cpp_extension.load(name="pdmesh_cpu_ops", sources=[str(p) for p in SOURCES],
                                 build_directory=str(out),
                                 extra_cflags=["-O3", "-march=native"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the torch path serves
        log.warning("C++ CPU ops unavailable (%s); using the torch path", e)
        return None
    if fresh:
        log.info("C++ CPU ops built in %.1fs", time.perf_counter() - t)
    return mod
