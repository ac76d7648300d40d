"""The C++ extension (SOURCES: kernels.cpp, the kernel files as one unit, and bind.cpp, the
Python module), built once per source, torch version and CPU.

torch.utils.cpp_extension compiles it with -O3 -march=native into
~/.cache/pdmesh/ext/ (PDMESH_EXT_DIR), keyed by a digest of the source, the torch version
and this CPU's flags, so a copy built on another processor is never loaded.
PDMESH_CPU_ARCH=x86-64-v3 (an image built for other machines) compiles for that baseline
instead and keys the build by it; a CPU without the baseline's features (avx2, fma for v3)
then uses the torch path rather than die on an illegal instruction. AMX is never used
(some kernels list it without granting it). A build already there is loaded as it is,
with no compiler (the image's final stage has none) and wherever the sources now are (a
`pip install`ed copy beside a checkout shares it, not recompiles it). `make venv`
builds it (`python -m kernels.cpu_ops`); a process that finds no build compiles it then
(~30 s on 2 cores). Concurrent processes take turns on an fcntl lock beside that folder,
which the kernel drops when its holder dies; torch's own lock file in the folder is only ever
taken under it, so one found there was left by a process killed mid-load (a SIGKILLed
service, a timed-out install) and is removed: otherwise every later process would wait on it
forever. No compiler, or PDMESH_CPU_EXT=0: load() returns None and the callers use the torch
reference.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger("pdmesh.kernels")
HERE = Path(__file__).parent
# compiled: kernels.cpp (every kernel file, one unit) and bind.cpp (the Python module)
SOURCES = (HERE / "kernels.cpp", HERE / "bind.cpp")
# in the build's digest, not compiled alone: the kernel files kernels.cpp includes, headers
KERNELS = tuple(HERE / f for f in ("ops.cpp", "kv_copy.cpp", "int4_gemv.cpp", "int8_gemv.cpp",
                                   "fused.cpp", "batch_gemm.cpp"))
HEADERS = KERNELS + tuple(HERE / f for f in ("aten.h", "bf16.h", "tiles.h", "simd.h",
                                             "helper.h", "lanes8.h"))
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


# what a stated baseline needs of the CPU (/proc/cpuinfo flags)
BASELINES = {"x86-64": (), "x86-64-v2": ("sse4_2", "popcnt", "ssse3"),
             "x86-64-v3": ("sse4_2", "popcnt", "avx2", "fma", "bmi2", "movbe"),
             "x86-64-v4": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")}


NO_AMX = (["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
          if os.uname().machine in ("x86_64", "amd64") else [])


def arch() -> str:
    """The -march the build targets: PDMESH_CPU_ARCH, else native."""
    return os.environ.get("PDMESH_CPU_ARCH", "") or "native"


def cpu_has(*flags: str) -> bool:
    """Whether this CPU lists any of these /proc/cpuinfo flags."""
    have = set(_cpu_flags().split())
    return any(f in have for f in flags)


def arch_missing(target: str) -> list[str]:
    """The features `target` needs that this CPU lacks (native: none)."""
    have = set(_cpu_flags().split())
    return [f for f in BASELINES.get(target, ()) if f not in have]


def build_dir() -> Path:
    key = _cpu_flags() if arch() == "native" else arch()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)
                            + Path(__file__).read_bytes() + torch.__version__.encode()
                            + key.encode()).hexdigest()[:16]
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


@contextmanager
def build_lock(out: Path):
    """Hold the build of `out` alone (an fcntl lock on `<out>.flock`, released by the
    kernel if this process dies); torch's lock file found inside is stale, and removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".flock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = out / "lock"
            if stale.exists():
                log.warning("removing %s, left by a process that died while loading the "
                            "C++ CPU ops", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _prebuilt(out: Path):
    """The module already built in out, imported as it is (no compiler, no ninja)."""
    import importlib.machinery
    import importlib.util

    so = next(iter(sorted(out.glob("pdmesh_cpu_ops*.so"))), None)
    if so is None:
        return None
    loader = importlib.machinery.ExtensionFileLoader("pdmesh_cpu_ops", str(so))
    spec = importlib.util.spec_from_file_location("pdmesh_cpu_ops", so, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _build():
    import sys

    from torch.utils import cpp_extension

    target = arch()
    if target != "native" and target not in BASELINES:
        log.warning("PDMESH_CPU_ARCH=%s is not one of %s; using the torch path", target,
                    ", ".join(BASELINES))
        return None
    missing = arch_missing(target)
    if missing:
        log.warning("this CPU lacks %s, which the C++ CPU ops' baseline %s needs; using "
                    "the torch path", ", ".join(missing), target)
        return None

    # ninja comes with the venv (requirements.txt): found on PATH by cpp_extension
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    out = build_dir()
    if os.environ.get("PDMESH_CPU_PREBUILT", "0") not in ("0", "false", "no"):
        try:
            mod = _prebuilt(out)
        except ImportError as e:
            log.warning("the prebuilt C++ CPU ops in %s do not load (%s)", out, e)
            mod = None
        if mod is not None:
            return mod
        log.warning("no prebuilt C++ CPU ops in %s; using the torch path", out)
        return None
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    fresh = not any(out.glob("*.so"))
    if fresh:
        log.info("building the C++ CPU ops in %s (once)", out)
    try:
        with build_lock(out):
            # a build already there is this source's (the folder is keyed by its digest):
            # loaded as it is, wherever the sources now live. Through cpp_extension, a copy
            # of them at another path (an installed package beside a checkout) would
            # recompile it (~30 s), and the other copy's next process again
            try:
                mod = _prebuilt(out)
            except ImportError as e:       # a .so cut short (killed mid-link): rebuilt
                log.warning("the C++ CPU ops in %s do not load (%s); rebuilding", out, e)
                mod = None
            if mod is not None:
                return mod
            mod = cpp_extension.load(name="pdmesh_cpu_ops", sources=[str(p) for p in SOURCES],
                                     build_directory=str(out),
                                     extra_cflags=["-O3", f"-march={target}", *NO_AMX,
                                                   "-ffp-contract=off"],
                                     verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the torch path serves
        log.warning("C++ CPU ops unavailable (%s); using the torch path", e)
        return None
    if fresh:
        log.info("C++ CPU ops built in %.1fs", time.perf_counter() - t)
    return mod
