"""A node's data on disk (``--persist DIR``): every stripe and the namespace, written through.

Each stripe is a file ``stripes/<fid>.<idx>.<snap>`` holding its region byte for byte (the 16-byte
header with version and clock, then the data); a commit writes the header and the range it
changed, in place. A stripe's tag (the view epoch of its version, which replicas compare with
it) is a line of ``tags.log`` whenever it changes or its file is new (a stripe's first version in
a new view, a snapshot's link, a rewrite), compacted as it grows and at load: without it a node
loaded every stripe as older than its peers' and its resync fetched them all again (at 4 GiB,
twice the memory of its data: ENOSPC). The namespace is ``meta.json``, replaced atomically
(write, rename) after every metadata op. On start the node loads both, then resyncs with its peers as always (the newest
version of a stripe wins). Writes reach the page cache, not the platter: the data survives the
node processes stopping, crashing or being killed, and the whole cluster restarting; add
``fsync`` per commit for power loss, at a price per write.

Work over every stripe at once (a snapshot's hard links, a dropped snapshot's files: one per
stripe; 4,096 ``link`` calls took 0.13 s here) is queued (``later``) and done by ``drain`` in a worker
thread, never on the node's loop. One order holds for all of it: an operation on a file first
does every queued one before it that touches the same file (under one lock, which the thread
takes per operation), so a stripe rewritten while its snapshot's link waits keeps the link's
old bytes. A snapshot answers once its links are done (``Behind.persisted``, behind.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter, deque
from pathlib import Path

from ..regions import HEADER

log = logging.getLogger(__name__)


class Persist:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.dir = self.root / "stripes"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, tuple[int, int, int], tuple[int, int, int] | None]] = deque()
        self._queued: Counter = Counter()  # key -> queued operations that touch its file
        self.tags: dict[tuple[int, int, int], int] = {}  # each file's tag, as tags.log says
        self._logged = 0  # lines in tags.log

    def _path(self, key: tuple[int, int, int]) -> Path:
        fid, idx, snap = key
        return self.dir / f"{fid}.{idx}.{snap}"

    # -- queued: done in a worker thread, in order --------------------------------------------
    def later(self, ops: list[tuple[str, tuple[int, int, int], tuple[int, int, int] | None]]) -> None:
        """Queue ("link", key, to) and ("remove", key, None) operations for ``drain``."""
        with self._lock:
            for op in ops:
                self._queue.append(op)
                self._queued.update(k for k in op[1:] if k is not None)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def drain(self) -> None:
        """Do every queued operation, one per turn of the lock (a worker thread's: ``link`` and
        ``unlink`` release the GIL)."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                self._do_next()

    def _settle(self, *keys: tuple[int, int, int]) -> None:
        """With the lock held: the queued operations up to the last that touches ``keys``."""
        while any(self._queued[k] for k in keys):
            self._do_next()

    def _do_next(self) -> None:
        kind, key, to = self._queue.popleft()
        for k in (key, to):
            if k is not None:
                self._queued[k] -= 1
                if not self._queued[k]:
                    del self._queued[k]
        try:
            if kind == "link":
                self._link(key, to)
            else:
                self._remove(key)
        except OSError as exc:  # the disk's trouble is logged, never the end of the node
            log.error("persist: %s of %s failed: %s", kind, self._path(key), exc)

    # -- at once: on the caller's thread, after what is queued for the same file ---------------
    def write(self, key: tuple[int, int, int], buf: memoryview, start: int = 0, end: int | None = None, header: int = HEADER, tag: int = 0) -> None:
        """Bytes [start, end) of the stripe's region (and its header) to its file, and its tag."""
        with self._lock:
            self._settle(key)
            self._write(key, buf, start, end, header)
            self._tag(key, tag)

    def _tag(self, key: tuple[int, int, int], tag: int) -> None:
        if self.tags.get(key, 0) != tag:
            with open(self.root / "tags.log", "a") as f:
                f.write(f"{key[0]} {key[1]} {key[2]} {tag}\n")
            self.tags[key] = tag
            self._logged += 1
            if self._logged > 2 * len(self.tags) + 4096:  # snapshots add a line a stripe: compact
                self._write_tags()

    def _write_tags(self) -> None:
        tmp = self.root / "tags.log.tmp"
        tmp.write_text("".join(f"{k[0]} {k[1]} {k[2]} {t}\n" for k, t in self.tags.items() if t))
        os.replace(tmp, self.root / "tags.log")
        self._logged = len(self.tags)

    def _write(self, key: tuple[int, int, int], buf: memoryview, start: int, end: int | None, header: int) -> None:
        end = len(buf) if end is None else end
        fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            if start >= header:  # a range at data offset 0 too: its header changed with it
                os.pwrite(fd, buf[:header], 0)
            os.pwrite(fd, buf[start:end], start)
        finally:
            os.close(fd)

    def remove(self, key: tuple[int, int, int]) -> None:
        with self._lock:
            self._settle(key)
            self._remove(key)

    def _remove(self, key: tuple[int, int, int]) -> None:
        self.tags.pop(key, None)  # a file made again writes its tag again
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def link(self, key: tuple[int, int, int], to: tuple[int, int, int]) -> None:
        """``to``'s file becomes a hard link to ``key``'s (a snapshot's entry shares the live
        stripe's memory: server/store.py). The store writes ``key``'s file anew before it
        changes it in place, so the link keeps the bytes as they were."""
        with self._lock:
            self._settle(key, to)
            self._link(key, to)

    def _link(self, key: tuple[int, int, int], to: tuple[int, int, int]) -> None:
        self._remove(to)
        try:
            os.link(self._path(key), self._path(to))
        except FileNotFoundError:  # never written (an empty stripe): nothing to share yet
            return
        self._tag(to, self.tags.get(key, 0))

    def _load_tags(self) -> None:
        """``tags`` from tags.log (the last line of a key wins; a torn last line is skipped),
        written again with one line per stripe file there is."""
        tags: dict[tuple[int, int, int], int] = {}
        path = self.root / "tags.log"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    fid, idx, snap, tag = (int(x) for x in line.split())
                except ValueError:
                    continue
                tags[(fid, idx, snap)] = tag
        self.tags = {k: t for k, t in tags.items() if t and self._path(k).exists()}
        self._write_tags()

    def save_meta(self, snapshot: dict) -> None:
        tmp = self.root / "meta.json.tmp"
        tmp.write_text(json.dumps(snapshot, separators=(",", ":")))
        os.replace(tmp, self.root / "meta.json")

    def load(self) -> tuple[dict | None, list[tuple[tuple[int, int, int], int, tuple[int, int, int] | None]]]:
        """The namespace (None if never saved) and every stripe file: its key, its size, and
        the key of an earlier file that is the same file (hard linked: a snapshot sharing a live
        stripe's bytes) or None. Live stripes come first; ``tags`` holds their tags. The bytes
        are read by ``read_into`` (a worker thread's, straight into the stripe's region)."""
        meta_path = self.root / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
        self._load_tags()
        found = []
        for f in self.dir.iterdir():
            try:
                fid, idx, snap = (int(x) for x in f.name.split("."))
            except ValueError:
                log.warning("persist: %s is not a stripe file; left alone", f)
                continue
            found.append(((fid, idx, snap), f))
        found.sort(key=lambda kf: (kf[0][0], kf[0][1], kf[0][2] != 0, kf[0][2]))
        stripes: list = []
        first: dict[tuple[int, int], tuple[int, int, int]] = {}  # (device, inode) -> the key loaded with it
        for key, f in found:
            st = f.stat()
            same = first.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
            if same is None:
                first[(st.st_dev, st.st_ino)] = key
            stripes.append((key, st.st_size, same))
        return meta, stripes

    def read_into(self, key: tuple[int, int, int], buf: memoryview) -> None:
        """``key``'s file into ``buf`` (its size: ``load``'s)."""
        with open(self._path(key), "rb", buffering=0) as f:
            done = 0
            while done < len(buf):
                n = f.readinto(buf[done:])
                if not n:
                    raise OSError(f"persist: {self._path(key)} ended at {done} of {len(buf)} bytes")
                done += n
