"""Storage core of the kvstore's tiered KV cache (HiCache L2 host memory, L3 disk).

A cache entry is one KV block: `key` (a 16-byte content hash, opaque here) names a
`BlockData` holding one bytes object per model layer plus that layer's crc32. A key
names its content, so writing a key that is already stored is a no-op, never an update.

    put ──> L2  MemoryTier   LRU over BlockData objects, byte budget
             │  evicted (LRU first) ──> demoted to L3, unless L3 already holds the key
             v
            L3  DiskTier     one file per block, written atomically, crc32 per layer,
                             LRU index rebuilt from the directory on restart

    get: L2 hit -> done; else L3 (verified read) -> promote into L2 (demoting what L2
    evicts; the L3 copy stays, so a later demotion costs no write); else miss.

A corrupt L3 file (bad crc, truncated, garbled header) is deleted, counted and reads as
a miss, so `fetch_prefix` stops there and the caller recomputes the rest of the prefix.
`longest_prefix` answers from both indexes without touching a file.

Budget 0 disables a tier. A disabled or too-small L2 hands the entry straight back as
"evicted", which is how it reaches L3. No NATS, no torch, no asyncio: the service wraps
this. DiskTier methods only touch their own state (under a lock), so they may run on a
thread executor; the rest assumes one thread.
"""
from __future__ import annotations

import os
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from shared.kv.wire import checksum as layer_checksum  # the one KV checksum (crc32)


@dataclass(frozen=True, slots=True)
class BlockData:
    layers: tuple[bytes, ...]      # one per model layer: K then V of that layer, raw bytes
    checksums: tuple[int, ...]     # layer_checksum of each layer

    def __post_init__(self):
        if len(self.layers) != len(self.checksums):
            raise ValueError(f"{len(self.layers)} layers but {len(self.checksums)} checksums")

    @property
    def nbytes(self) -> int:
        return sum(len(layer) for layer in self.layers)

    @classmethod
    def build(cls, layers) -> BlockData:
        layers = tuple(bytes(layer) for layer in layers)  # bytes(bytes) is not a copy
        return cls(layers, tuple(layer_checksum(layer) for layer in layers))

    def verify(self) -> bool:
        return all(layer_checksum(l) == c for l, c in zip(self.layers, self.checksums))


# ---- L2: host memory ---------------------------------------------------------------------

class MemoryTier:
    """LRU of BlockData under a byte budget (sum of nbytes)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, BlockData] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> BlockData | None:
        data = self._entries.get(key)
        if data is not None:
            self._entries.move_to_end(key)
        return data

    def put(self, key: bytes, data: BlockData) -> list[tuple[bytes, BlockData]]:
        """Store `data`; return what was evicted for it, LRU first, for the caller to
        demote. An entry that cannot fit at all (or a disabled tier) returns itself."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return []
        size = data.nbytes
        if not self.budget_bytes or size > self.budget_bytes:
            return [(key, data)]
        evicted = []
        while self.bytes_used + size > self.budget_bytes:
            old_key, old = self._entries.popitem(last=False)
            self.bytes_used -= old.nbytes
            self.evictions += 1
            evicted.append((old_key, old))
        self._entries[key] = data
        self.bytes_used += size
        return evicted

    def pop(self, key: bytes) -> BlockData | None:
        data = self._entries.pop(key, None)
        if data is not None:
            self.bytes_used -= data.nbytes
        return data


# ---- L3: disk ----------------------------------------------------------------------------
# File: header | layer bytes in order. Header (little-endian):
#   b"PDKV", version u16, n_layers u32, then per layer: length u64, crc32 u32.
MAGIC = b"PDKV"
VERSION = 1
_HEAD = struct.Struct("<4sHI")
_LAYER = struct.Struct("<QI")


def file_size(data: BlockData) -> int:
    """Bytes the block takes on disk: what the L3 budget counts."""
    return _HEAD.size + _LAYER.size * len(data.layers) + data.nbytes


class CorruptBlock(Exception):
    """An L3 file that does not decode or whose crc32 disagrees with its header."""


class DiskTier:
    """One file per block under `directory` (`ab/abcd...` fan-out), LRU by an in-memory
    index of file sizes; `bytes_used` is the sum of the sizes of the files on disk."""

    def __init__(self, directory: str | Path, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self.evictions = 0
        self.checksum_failures = 0
        self.write_failures = 0
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._lock = threading.RLock()
        self._clock_ns = 0       # mtimes we set strictly increase, so restart keeps LRU order
        if budget_bytes:         # disabled: leave whatever is in the directory alone
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()
            self._evict_to(self.budget_bytes)   # the budget may have shrunk since last run

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def put(self, key: bytes, data: BlockData) -> None:
        """Write the block atomically, first evicting LRU files to stay within budget.
        A block larger than the whole budget is not stored. A failed write (disk full)
        is counted and dropped: this is a cache."""
        size = file_size(data)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            if not self.budget_bytes or size > self.budget_bytes:
                return
            self._evict_to(self.budget_bytes - size)
            path = self._path(key)
            try:
                self._write(path, data)
            except OSError:
                self.write_failures += 1
                return
            self._index[key] = size
            self.bytes_used += size

    def get(self, key: bytes) -> BlockData | None:
        """Read and verify the block; a corrupt file is deleted and reads as a miss."""
        with self._lock:
            if key not in self._index:
                return None
            path = self._path(key)
            try:
                data = self._read(path)
            except FileNotFoundError:        # removed behind our back: just forget it
                self._forget(key)
                return None
            except (CorruptBlock, OSError):
                self.checksum_failures += 1
                self._remove(key)
                return None
            self._index.move_to_end(key)
            self._touch(path)
            return data

    def pop(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._index:
                return False
            self._remove(key)
            return True

    # ---- files ---------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / name

    def _write(self, path: Path, data: BlockData) -> None:
        # tmp file in the same directory + os.replace: readers see the old state or the
        # whole file. No fsync: after a power loss the crc32s catch a torn file.
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEAD.pack(MAGIC, VERSION, len(data.layers)))
                f.write(b"".join(_LAYER.pack(len(l), c)
                                 for l, c in zip(data.layers, data.checksums)))
                for layer in data.layers:
                    f.write(layer)
                f.flush()
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        self._touch(path)

    @staticmethod
    def _read(path: Path) -> BlockData:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_HEAD.size)
            if len(head) != _HEAD.size:
                raise CorruptBlock("short header")
            magic, version, n = _HEAD.unpack(head)
            if magic != MAGIC or version != VERSION:
                raise CorruptBlock(f"bad magic/version {magic!r} {version}")
            table_size = _LAYER.size * n
            if _HEAD.size + table_size > size:
                raise CorruptBlock("short layer table")
            table = list(_LAYER.iter_unpack(f.read(table_size)))
            # check the total before reading, so a garbled length cannot ask for 2**63 bytes
            if _HEAD.size + table_size + sum(length for length, _ in table) != size:
                raise CorruptBlock("size disagrees with header (truncated?)")
            layers = []
            for length, crc in table:
                layer = f.read(length)
                if len(layer) != length or layer_checksum(layer) != crc:
                    raise CorruptBlock("crc32 mismatch")
                layers.append(layer)
        return BlockData(tuple(layers), tuple(crc for _, crc in table))

    def _touch(self, path: Path) -> None:
        self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
        try:
            os.utime(path, ns=(self._clock_ns, self._clock_ns))
        except OSError:
            pass

    def _scan(self) -> None:
        """Rebuild the index from the directory: sizes from stat, LRU order by mtime;
        delete `*.tmp` left by a crash mid-write. Other files are left alone."""
        found = []
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False):
                if sub.name.endswith(".tmp"):
                    os.unlink(sub.path)
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(".tmp"):
                    os.unlink(e.path)
                    continue
                if not e.is_file(follow_symlinks=False) or e.name[:2] != sub.name:
                    continue
                try:
                    key = bytes.fromhex(e.name)
                except ValueError:
                    continue
                st = e.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, e.name, key, st.st_size))
        for mtime_ns, _, key, size in sorted(found):
            self._index[key] = size
            self.bytes_used += size
            self._clock_ns = max(self._clock_ns, mtime_ns)

    def _evict_to(self, limit: int) -> None:
        while self._index and self.bytes_used > limit:
            key = next(iter(self._index))
            self._remove(key)
            self.evictions += 1

    def _remove(self, key: bytes) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        self._forget(key)

    def _forget(self, key: bytes) -> None:
        self.bytes_used -= self._index.pop(key)


# ---- the store ---------------------------------------------------------------------------

class TieredStore:
    """L2 over optional L3, with demotion on L2 eviction and promotion on L3 hit."""

    def __init__(self, l2: MemoryTier, l3: DiskTier | None, write_through_l3: bool = False):
        self.l2 = l2
        self.l3 = l3 if l3 is not None and l3.budget_bytes else None
        self.write_through_l3 = write_through_l3
        self.lookups = self.misses = self.l2_hits = self.l3_hits = 0

    def put(self, key: bytes, data: BlockData) -> None:
        if self.write_through_l3:
            self._demote(key, data)
        self._demote_all(self.l2.put(key, data))

    def get(self, key: bytes) -> BlockData | None:
        self.lookups += 1
        data = self.l2.get(key)
        if data is not None:
            self.l2_hits += 1
            return data
        data = self.l3.get(key) if self.l3 is not None else None
        if data is None:
            self.misses += 1
            return None
        self.l3_hits += 1
        self._demote_all(self.l2.put(key, data))   # promote; the L3 copy stays
        return data

    def longest_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are held, from the indexes alone (no file reads)."""
        n = 0
        for key in keys:
            if not (self.l2.contains(key) or (self.l3 is not None and self.l3.contains(key))):
                break
            n += 1
        return n

    def fetch_prefix(self, keys: list[bytes]) -> list[BlockData]:
        """The leading blocks, in order, up to the first miss or corrupt L3 file."""
        out = []
        for key in keys:
            data = self.get(key)
            if data is None:
                break
            out.append(data)
        return out

    def stats(self) -> dict:
        l2, l3, n = self.l2, self.l3, self.lookups
        return {
            "l2_entries": len(l2), "l2_bytes": l2.bytes_used,
            "l2_budget_bytes": l2.budget_bytes, "l2_hits": self.l2_hits,
            "l2_evictions": l2.evictions,
            "l3_entries": len(l3) if l3 is not None else 0,
            "l3_bytes": l3.bytes_used if l3 is not None else 0,
            "l3_budget_bytes": l3.budget_bytes if l3 is not None else 0,
            "l3_hits": self.l3_hits,
            "l3_evictions": l3.evictions if l3 is not None else 0,
            "lookups": n, "misses": self.misses,
            "checksum_failures": l3.checksum_failures if l3 is not None else 0,
            "l2_hit_rate": self.l2_hits / n if n else 0.0,
            "l3_hit_rate": self.l3_hits / n if n else 0.0,
        }

    def _demote(self, key: bytes, data: BlockData) -> None:
        if self.l3 is not None and not self.l3.contains(key):
            self.l3.put(key, data)

    def _demote_all(self, evicted: list[tuple[bytes, BlockData]]) -> None:
        for key, data in evicted:
            self._demote(key, data)
