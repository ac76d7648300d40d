"""Shared-memory segments for same-host KV writes (the transport: shm_transport.py).

A writer owns one segment: a file in /dev/shm (tmpfs), allocated up front with
posix_fallocate (a full /dev/shm fails here, never later with SIGBUS), mapped read-write,
carved into regions by a first-fit allocator. A reader opens only segments their writer
announced, checks what it opened (Segments), and copies a region out with pread (one
memcpy; never a mapping a writer could truncate under it). The handle that travels is
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
import stat
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
    """The reader's handles on writers' segments (the most recent `keep`, by name).

    Nothing a write names is trusted (issue 29: decode used to open whatever
    /dev/shm/pdmesh-kv-* name a write gave, following symlinks, so with prefill's
    credentials and a symlink a root-only file was read through the digest answers; and
    truncating a segment decode had mapped killed it with SIGBUS). A segment is read only
    if its writer announced it (decode: from the writer's heartbeat, shm_transport), and it
    is opened with O_NOFOLLOW and kept only if it is a regular file of this user, mode
    0600, one link, on /dev/shm's own device, of a sane size. It is never mapped: a region
    is read with pread into memory of our own, so a segment truncated meanwhile is a short
    read (ShmUnavailable), never a SIGBUS."""

    MAX_SEGMENT = 1 << 34        # 16 GiB: larger is no segment of ours

    def __init__(self, keep: int = 16, directory: Path = SHM_DIR):
        self.keep, self.directory = keep, directory
        self.fds: OrderedDict[str, tuple[int, int]] = OrderedDict()    # name -> (fd, size)

    def region(self, handle: str) -> memoryview:
        """A copy of the bytes a handle names. ShmUnavailable when they cannot be read."""
        try:
            name, off, n = handle.rsplit(":", 2)
            off, n = int(off), int(n)
        except ValueError as e:
            raise ShmUnavailable(f"bad shared-memory handle {handle!r}") from e
        if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
            raise ShmUnavailable(f"not a pdmesh segment: {name!r}")
        fd, size = self.fds.get(name) or self._open(name)
        self.fds.move_to_end(name)
        if off < 0 or n < 0 or off + n > size:
            raise ShmUnavailable(f"{handle}: outside the segment ({size} B)")
        buf = bytearray(n)
        try:
            got = os.preadv(fd, [buf], off) if n else 0
        except OSError as e:
            raise ShmUnavailable(f"{handle}: cannot read: {e}") from e
        if got != n:
            raise ShmUnavailable(f"{handle}: the segment is shorter than announced "
                                 f"(read {got} of {n} B)")
        return memoryview(buf).toreadonly()

    def _open(self, name: str) -> tuple[int, int]:
        try:
            fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK)
        except OSError as e:
            raise ShmUnavailable(f"cannot open {name}: {e}") from e
        try:
            why = self._unsafe(os.fstat(fd))
        except OSError as e:
            why = str(e)
        if why:
            os.close(fd)
            raise ShmUnavailable(f"refusing {name}: {why}")
        entry = (fd, os.fstat(fd).st_size)
        self.fds[name] = entry
        while len(self.fds) > self.keep:
            _, (old, _) = self.fds.popitem(last=False)
            os.close(old)
        return entry

    def _unsafe(self, st: os.stat_result) -> str:
        """Why a segment file is not one a writer of this mesh made; "" when it is."""
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_uid != os.geteuid():
            return f"owned by uid {st.st_uid}, not {os.geteuid()}"
        if st.st_mode & 0o077:
            return f"mode {stat.S_IMODE(st.st_mode):o}, not 600"
        if st.st_nlink != 1:
            return f"{st.st_nlink} links (a hard link to another file?)"
        if st.st_dev != os.stat(self.directory).st_dev:
            return "not on the shared-memory file system"
        if not 0 < st.st_size <= self.MAX_SEGMENT:
            return f"size {st.st_size}"
        return ""

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()
