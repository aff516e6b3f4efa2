"""The disk tier: evicted prefix blocks as files, LRU within a byte bound, found again after a restart.

One file per block, named by its chained prefix hash and a tag of the engine's identity (so engines of other
dtypes, layouts or tensor-parallel sizes that use the directory in turn keep their own files of the same
prefix instead of overwriting each other's; files named by the hash alone, as earlier versions wrote them,
are still read). A file holds a header (format version, the engine's
identity: model, KV dtype, block size, the KV shape; the block's parent hash and tokens; the
payload's length and CRC-32) and the block's bytes. At start the directory's headers are read into an index;
a file of another format, identity or a damaged header is ignored and counted, never served, and a payload
whose checksum fails at load time is a miss (the file is removed). Writes go through a background thread
(write to a temporary name, then rename), so a step never waits on the disk; the thread also removes the least
recently used files to keep the tier under its bound.

A lock file keeps two engines from sharing a directory: the second one runs without the disk tier and says so.
A read-only directory is served from but never written; a path that cannot be made a directory is refused at
start. Full disks and I/O errors are logged and counted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpage.kv.host_tier import TierEntry
from kvpage.kv.prefix_hash import BlockHash

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"KVPGBLK1"
_HEAD = struct.Struct("<8sHI")  # magic, format version, header length
_SUFFIX = ".kvblock"
LOCK_NAME = ".kvpage-offload.lock"


@dataclass
class DiskCounters:
    ignored_files: int = 0  # another format or identity, or an unreadable header: never served
    corrupt_blocks: int = 0  # a checksum or length that failed at load time
    write_errors: int = 0
    evictions: int = 0
    writes: int = 0


@dataclass
class _DiskEntry:
    entry: TierEntry
    path: Path
    size: int


@dataclass
class DiskTier:
    """``directory`` for ``identity`` (what a file must match to be served), at most ``max_bytes`` of files."""

    directory: Path
    identity: dict
    max_bytes: int
    counters: DiskCounters = field(default_factory=DiskCounters)
    on_removed: Callable[[list[BlockHash]], None] | None = None
    on_stored: Callable[[TierEntry], None] | None = None

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, _DiskEntry] = OrderedDict()  # LRU first
        self._pending: set[BlockHash] = set()
        self.used_bytes = 0
        self.enabled = True
        self.writable = True
        self.status = "ok"
        self._lock_fd: int | None = None
        self._queue: queue.Queue = queue.Queue()
        self._ident = json.dumps(self.identity, sort_keys=True)
        self._tag = hashlib.sha256(self._ident.encode()).hexdigest()[:16]
        self._open()
        self._thread: threading.Thread | None = None
        if self.enabled and self.writable:
            self._thread = threading.Thread(target=self._writer, name="kvpage-disk-tier", daemon=True)
            self._thread.start()

    # ----------------------------------------------------------------- start
    def _open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # a path that cannot be a directory is the caller's mistake, not a state to run around: refuse it
            # at start (a directory that exists but is read-only or in use still runs, as below)
            what = "is a file, not a directory" if self.directory.is_file() else f"cannot be created: {e.strerror}"
            raise ValueError(f"KV offload directory {self.directory} {what}") from None
        lock = self.directory / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            try:
                fd = os.open(lock, os.O_RDONLY)
            except OSError:
                fd = None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                self._disable(f"the KV offload directory {self.directory} is in use by another kvpage engine "
                              f"(lock {lock} held): running without the disk tier")
                return
            self._lock_fd = fd
        if not os.access(self.directory, os.W_OK):
            self.writable = False
            self.status = "read-only"
            logger.warning("the KV offload directory %s is not writable: its blocks are served, none are written",
                           self.directory)
        self._scan()

    def _disable(self, why: str) -> None:
        self.enabled = self.writable = False
        self.status = why
        logger.warning("%s", why)

    def _scan(self) -> None:
        found = []
        for path in self.directory.glob(f"*{_SUFFIX}"):
            try:
                with open(path, "rb") as f:
                    meta = _read_header(f)
                st = path.stat()
            except (OSError, ValueError):
                self.counters.ignored_files += 1
                continue
            if meta.get("identity") != self._ident:
                self.counters.ignored_files += 1
                continue
            try:
                entry = _entry_of(meta)
            except (KeyError, TypeError, ValueError):
                self.counters.ignored_files += 1
                continue
            if path.name not in (self.file_name(entry.block_hash), entry.block_hash.hex() + _SUFFIX):
                self.counters.ignored_files += 1
                continue
            found.append((st.st_mtime, entry, path, st.st_size))
        for _, entry, path, size in sorted(found, key=lambda x: x[0]):
            self._index[entry.block_hash] = _DiskEntry(entry, path, size)
            self.used_bytes += size
        if self.counters.ignored_files:
            logger.warning("KV offload directory %s: %d files of another model, dtype, block size or format (or "
                           "damaged) ignored", self.directory, self.counters.ignored_files)
        if self._index:
            logger.info("KV offload directory %s: %d prefix blocks (%d bytes) from earlier runs", self.directory,
                        len(self._index), self.used_bytes)
        self._trim(keep=None)

    def file_name(self, block_hash: BlockHash) -> str:
        """``<prefix hash>.<identity tag>.kvblock``."""
        return f"{block_hash.hex()}.{self._tag}{_SUFFIX}"

    # ---------------------------------------------------------------- lookups
    def __len__(self) -> int:
        return len(self._index)

    def hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index)

    def has(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def find(self, block_hash: BlockHash, parent_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Whether a verified file for this exact block is on disk (its payload is checked when read)."""
        if not self.enabled:
            return False
        with self._lock:
            d = self._index.get(block_hash)
            return d is not None and d.entry.matches(parent_hash, token_ids)

    def read(self, block_hash: BlockHash, payload_bytes: int) -> bytes | None:
        """The block's bytes, checksum verified, or None (missing, damaged: counted, the file removed)."""
        with self._lock:
            d = self._index.get(block_hash)
            if d is not None:
                self._index.move_to_end(block_hash)
        if d is None:
            return None
        try:
            with open(d.path, "rb") as f:
                meta = _read_header(f)
                payload = f.read(payload_bytes + 1)
            ok = (meta.get("identity") == self._ident and len(payload) == payload_bytes
                  and meta.get("payload_bytes") == payload_bytes and zlib.crc32(payload) == meta.get("crc32"))
        except (OSError, ValueError):
            ok, payload = False, b""
        if ok:
            return payload
        self.counters.corrupt_blocks += 1
        logger.warning("KV offload file %s failed its check (truncated or corrupted): ignored and removed", d.path)
        self._drop(block_hash, unlink=self.writable)
        return None

    # ----------------------------------------------------------------- writes
    def put(self, entry: TierEntry, payload: bytes) -> None:
        """Queue a block for writing (the caller's step goes on at once)."""
        if not (self.enabled and self.writable):
            return
        with self._lock:
            if entry.block_hash in self._index or entry.block_hash in self._pending:
                return
            self._pending.add(entry.block_hash)
        self._queue.put((entry, payload))

    def flush(self) -> None:
        """Wait until every queued write is done (tests, shutdown)."""
        if self._thread is not None:
            self._queue.join()

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                entry, payload = item
                self._write(entry, payload)
            finally:
                self._queue.task_done()

    def _write(self, entry: TierEntry, payload: bytes) -> None:
        h = entry.block_hash
        path = self.directory / self.file_name(h)
        meta = {"identity": self._ident, "hash": h.hex(), "parent": entry.parent_hash.hex(),
                "tokens": list(entry.token_ids), "first": entry.first,
                "payload_bytes": len(payload), "crc32": zlib.crc32(payload)}
        header = json.dumps(meta, separators=(",", ":")).encode()
        size = _HEAD.size + len(header) + len(payload)
        if size > self.max_bytes:
            with self._lock:
                self._pending.discard(h)
            return
        with self._lock:  # room first: the bound holds while the file is being written
            self._trim(keep=size)
        tmp = path.with_suffix(".tmp")
        try:
            self._write_file(tmp, _HEAD.pack(_MAGIC, FORMAT_VERSION, len(header)) + header, payload)
            os.replace(tmp, path)
        except OSError as e:
            self.counters.write_errors += 1
            with self._lock:
                self._pending.discard(h)
            _unlink(tmp)
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.writable = False
                self.status = "read-only"
            logger.warning("KV offload write to %s failed (%s): the block stays uncached on disk%s", path,
                           e.strerror or e, "; no more writes" if not self.writable else "")
            return
        with self._lock:
            self._pending.discard(h)
            self._index[h] = _DiskEntry(entry, path, size)
            self.used_bytes += size
            self.counters.writes += 1
        if self.on_stored is not None:
            self.on_stored(entry)

    @staticmethod
    def _write_file(path: Path, head: bytes, payload: bytes) -> None:
        with open(path, "wb") as f:
            f.write(head)
            f.write(payload)

    def _trim(self, keep: int | None) -> None:
        """Remove LRU files until ``keep`` more bytes fit under the bound (caller holds the lock, or at start)."""
        need = keep or 0
        removed = []
        while self._index and self.used_bytes + need > self.max_bytes:
            h, d = self._index.popitem(last=False)
            self.used_bytes -= d.size
            self.counters.evictions += 1
            removed.append(h)
            if self.writable:
                _unlink(d.path)
        if removed and self.on_removed is not None:
            self.on_removed(removed)

    def _drop(self, h: BlockHash, unlink: bool) -> None:
        with self._lock:
            d = self._index.pop(h, None)
            if d is None:
                return
            self.used_bytes -= d.size
        if unlink:
            _unlink(d.path)
        if self.on_removed is not None:
            self.on_removed([h])

    def clear(self) -> int:
        """Remove every block file of this identity (reset_prefix_cache)."""
        self.flush()
        with self._lock:
            hashes = list(self._index)
        for h in hashes:
            self._drop(h, unlink=self.writable)
        return len(hashes)

    def close(self) -> None:
        """Finish the queued writes and let the directory go; idempotent (later blocks are not written)."""
        self.enabled = self.writable = False
        if self._thread is not None:
            self.flush()
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _read_header(f) -> dict:
    head = f.read(_HEAD.size)
    if len(head) != _HEAD.size:
        raise ValueError("short header")
    magic, version, n = _HEAD.unpack(head)
    if magic != _MAGIC or version != FORMAT_VERSION or n > 1 << 20:
        raise ValueError("not a kvpage block file of this format")
    raw = f.read(n)
    if len(raw) != n:
        raise ValueError("short header")
    return json.loads(raw)


def _entry_of(meta: dict) -> TierEntry:
    return TierEntry(bytes.fromhex(meta["hash"]), bytes.fromhex(meta["parent"]), tuple(int(t) for t in meta["tokens"]),
                     bool(meta["first"]))
