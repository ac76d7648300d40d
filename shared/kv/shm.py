"""Shared-memory segments for same-host KV writes (the transport: shm_transport.py).

A writer owns one segment: a file in /dev/shm (tmpfs), allocated up front with
posix_fallocate (a full /dev/shm fails here, never later with SIGBUS), mapped read-write,
carved into regions by a first-fit allocator. A reader maps a writer's segment read-only
by name and hands out memoryviews of its regions (no copy). The handle that travels is
"name:offset:length". Segment names carry the writer's pid, so a writer that starts sweeps
the segments of writers that died without unlinking theirs.

host_id() names what shares /dev/shm: the boot, the hostname and the device of /dev/shm
(two containers on one machine have different ones unless they share it).
"""
from __future__ import annotations

import bisect
import functools
import mmap
import os
import socket
import uuid
from collections import OrderedDict
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "pdmesh-kv-"
ALIGN = 4096


class ShmUnavailable(OSError):
    """This segment cannot be created or opened here."""


@functools.cache
def host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return ""      # no /dev/shm (not Linux): never the same host as anyone
    return f"{socket.gethostname()}/{boot}/{dev}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead(directory: Path = SHM_DIR) -> int:
    """Unlink segments whose writer process is gone; how many."""
    n = 0
    for f in directory.glob(PREFIX + "*"):
        try:
            pid = int(f.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not _alive(pid):
            f.unlink(missing_ok=True)
            n += 1
    return n


class Arena:
    """The writer's segment and its free list."""

    def __init__(self, size: int, directory: Path = SHM_DIR):
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = directory / self.name
        self.size = -(-size // ALIGN) * ALIGN
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise ShmUnavailable(f"cannot create {self.path}: {e}") from e
        try:
            os.posix_fallocate(fd, 0, self.size)
            self.map = mmap.mmap(fd, self.size)
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise ShmUnavailable(f"cannot allocate {self.size} B in {directory}: {e}") from e
        os.close(fd)
        self.free_list: list[tuple[int, int]] = [(0, self.size)]   # (offset, length), sorted
        self.used: dict[int, int] = {}                              # offset -> length
        self.view = memoryview(self.map)

    def alloc(self, n: int) -> int | None:
        n = -(-n // ALIGN) * ALIGN
        for i, (off, ln) in enumerate(self.free_list):
            if ln >= n:
                if ln == n:
                    del self.free_list[i]
                else:
                    self.free_list[i] = (off + n, ln - n)
                self.used[off] = n
                return off
        return None

    def free(self, off: int) -> None:
        n = self.used.pop(off)
        i = bisect.bisect(self.free_list, (off, n))
        self.free_list.insert(i, (off, n))
        # merge with the neighbours
        if i + 1 < len(self.free_list) and off + n == self.free_list[i + 1][0]:
            n += self.free_list.pop(i + 1)[1]
            self.free_list[i] = (off, n)
        if i > 0 and self.free_list[i - 1][0] + self.free_list[i - 1][1] == off:
            po, pn = self.free_list.pop(i - 1)
            self.free_list[i - 1] = (po, pn + n)

    @property
    def bytes_used(self) -> int:
        return sum(self.used.values())

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        try:
            self.view.release()
            self.map.close()
        except BufferError:     # a region is still referenced: the mapping goes with it
            pass


class Segments:
    """The reader's mappings of writers' segments (the most recent `keep`)."""

    def __init__(self, keep: int = 16, directory: Path = SHM_DIR):
        self.keep, self.directory = keep, directory
        self.maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def region(self, handle: str) -> memoryview:
        """The bytes a handle names (read only). ShmUnavailable when they cannot be read."""
        try:
            name, off, n = handle.rsplit(":", 2)
            off, n = int(off), int(n)
        except ValueError as e:
            raise ShmUnavailable(f"bad shared-memory handle {handle!r}") from e
        if not name.startswith(PREFIX) or "/" in name:
            raise ShmUnavailable(f"not a pdmesh segment: {name!r}")
        m = self.maps.get(name)
        if m is None:
            m = self._open(name)
        self.maps.move_to_end(name)
        if off < 0 or n < 0 or off + n > len(m):
            raise ShmUnavailable(f"{handle}: outside the segment ({len(m)} B)")
        return memoryview(m)[off:off + n].toreadonly()

    def _open(self, name: str) -> mmap.mmap:
        try:
            with open(self.directory / name, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ShmUnavailable(f"cannot map {name}: {e}") from e
        self.maps[name] = m
        while len(self.maps) > self.keep:
            _, old = self.maps.popitem(last=False)
            try:
                old.close()
            except BufferError:
                pass
        return m

    def close(self) -> None:
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:
                pass
        self.maps.clear()
