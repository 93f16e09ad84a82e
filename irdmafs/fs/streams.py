"""A training step as one stream per direction: ``.workers/<rank>/<model>.safetensors``.

Written, the stream is every gradient of one step of ``rank`` (a safetensors stream, tensors
named as in the model's view: ``a.b`` is ``<model>/a.b.npy``); read, it is every parameter as
the model's sync policy lets ``rank`` see them. One open, one stream of 1 MiB requests and one
close per direction and step, instead of an open, writes or reads, a flush and a close per
tensor: the per-file work of the mount costs more than the bytes for real models. The pieces
travel as the per-tensor paths send them (``Client.push`` and ``Client.pull_into``), all at
once, so pushes to one node fuse into few WRITEs with immediate; parameters up to GROUP_BYTES
are pulled together (``PushPull.pull_many``: per node, one burst of headers and one of data),
so a model's hundreds of small tensors cost a few round trips, not two each.

- **Push** (``PushStreamHandle``): the bytes are gathered at their offsets into one buffer (the
  one copy the mount makes); at flush the header is parsed and every entry checked against the
  tensor it names (exists, same dtype and shape, no name twice, the data all there) before
  anything is sent: a malformed stream gets EINVAL and pushes nothing. Tensors the stream does
  not name are not pushed (a partial step: the sync policy waits for them as for any push).
- **Pull** (``PullStreamHandle``): at open the header is laid out and every tensor pulled into
  one buffer, concurrently; reads answer from it.

The layout of a model (its tensors, dtypes, shapes, inodes) is cached per mount for
``LAYOUT_SECONDS`` and dropped at any namespace change this mount makes: a push naming a tensor
the cache does not know reads the layout again before refusing it. Buffers are kept per (rank,
model) between steps: a fresh 100 MB buffer per step costs more in page faults than its copy.

Concurrency: one trio thread. A stream handle's state is touched only by requests on it.
"""

from __future__ import annotations

import errno
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import trio

from typing import TYPE_CHECKING, Iterator

from .. import formats
from ..names import LAYOUT_CHANGED
from ..errors import FsError, RemoteError
from ..util import leaves, single_exception
from . import views
from ..packing import in_force

if TYPE_CHECKING:
    from ..client.client import Client

log = logging.getLogger(__name__)

LAYOUT_SECONDS = 60.0  # as long as the kernel caches .workers entries (inodes.WORK_CACHE_SECONDS)
GROUP_BYTES = 256 << 10  # parameters up to this size are pulled together (PushPull.pull_many)


@dataclass(eq=False)
class Bucket:
    """A bucket of a model's layout (docs/buckets.md): its inode and version as laid out, its
    elements, and its members as (stream entry, tensor file attributes, element they start at)."""

    fid: int
    version: int
    dtype: np.dtype
    count: int
    members: list
    # where the bucket's bytes lie whole in the model's stream (its members back to back, in the
    # bucket's order: a pack lays them out so), or None: pushed and pulled there, with no copy
    direct: int | None = None


@dataclass
class Layout:
    """A model's stream: header bytes and, in data order, (entry, tensor file attributes); the
    buckets its small tensors are packed in."""

    header: bytes
    parts: list
    at: float
    buckets: list = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.header) + (self.parts[-1][0].end if self.parts else 0)

    def by_name(self) -> dict:
        return {e.name: (e, a) for e, a in self.parts}

    @property
    def apart(self) -> list:
        """The parts that are not packed: pushed and pulled each as its own tensor."""
        return [(e, a) for e, a in self.parts if not in_force(a)]


@dataclass
class Streams:
    """What a step stream works with, through the files or the door: the mount's client and
    its layouts of models."""

    client: "Client"
    layouts: "Layouts"


class Layouts:
    """Per-mount cache of model layouts, and the reusable stream buffers."""

    def __init__(self, client) -> None:
        self.client = client
        self._cache: dict[int, Layout] = {}
        self._buffers: dict[tuple[str, int, int], bytearray] = {}

    async def get(self, model: int, *, fresh: bool = False) -> Layout:
        """The model's layout (cached); laid out anew, its small tensors are packed first if
        they can be (a model no rank has pushed to yet: client/buckets.py)."""
        cached = self._cache.get(model)
        if fresh or cached is None or trio.current_time() - cached.at > LAYOUT_SECONDS:
            header, parts = await views.layout(self.client, model)
            if await self._pack(parts):  # (here or by another mount meanwhile)
                header, parts = await views.layout(self.client, model)
            cached = self._cache[model] = Layout(header, parts, trio.current_time(), await self._buckets(parts, len(header)))
        return cached

    async def _pack(self, parts: list) -> bool:
        by_dir: dict[int, list[dict]] = {}
        for _, attr in parts:
            by_dir.setdefault(attr.get("parent", 0), []).append(attr)
        packed = False
        for directory, attrs in by_dir.items():
            packed = await self.client.buckets.pack(directory, attrs) or packed
        return packed

    async def _buckets(self, parts: list, head: int) -> list[Bucket]:
        """The buckets the packed ones of ``parts`` live in, as the namespace has them now (and
        where each lies whole in the stream, after its ``head`` bytes of header, if it does)."""
        found: dict[int, Bucket] = {}
        for e, attr in parts:
            ptr = in_force(attr)
            if ptr is None:
                continue
            b = found.get(ptr["fid"])
            if b is None:
                battr = await self.client.getattr(ptr["fid"])
                t = battr["tensor"]
                b = found[ptr["fid"]] = Bucket(ptr["fid"], battr["version"], np.dtype(t["dtype"]), t["shape"][0], [])
            b.members.append((e, attr, ptr["at"] // b.dtype.itemsize))
        for b in found.values():
            b.members.sort(key=lambda m: m[2])
            ends = [(e.begin, e.end, at * b.dtype.itemsize) for e, _, at in b.members]
            whole = ends[0][2] == 0 and ends[-1][1] - ends[0][0] == b.count * b.dtype.itemsize
            if whole and all(x[1] == y[0] and y[0] - ends[0][0] == y[2] for x, y in zip(ends, ends[1:])):
                b.direct = head + ends[0][0]
        return list(found.values())

    def forget(self) -> None:
        """The namespace changed through this mount: tensors may have come or gone."""
        self._cache.clear()

    def take(self, kind: str, rank: int, model: int, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes for one stream (the one kept from the last
        step when it fits). The client may still keep pushes of a round not yet closed as
        views of it (Client.push): they are copied out before it is written again."""
        buf = self._buffers.pop((kind, rank, model), None)
        if buf is None or len(buf) < size or len(buf) > 2 * size + (1 << 20):
            buf = bytearray(size)
        else:
            self.client.training.detach(buf)
        return buf

    def give_back(self, kind: str, rank: int, model: int, buf: bytearray) -> None:
        self._buffers[(kind, rank, model)] = buf


async def push_stream(streams: Streams, rank: int, model: int, data: memoryview, *, owner: object, only: set[str] | None = None) -> None:
    """Push one step's gradients of ``rank``: ``data`` is a safetensors stream of them (what a
    push stream handle gathered, or a door's push area), or of those named in ``only``. Every
    entry is checked against the model first, so a bad stream gets EINVAL and pushes nothing;
    then all go at once. The client may keep views of ``data`` for open rounds until ``owner``
    is detached."""
    pushes = await _validate(streams, rank, model, data, only)
    layout, whole = await _whole_buckets(streams, model, pushes)
    with _layout_held(streams), single_exception():
        async with trio.open_nursery() as n:
            for k, b in enumerate(whole):
                n.start_soon(_push_bucket, streams, rank, b, (pushes, data, owner, layout.header), k)
            known = layout.by_name()
            singles = [p for name, p in pushes.items() if not in_force(known[name][1])]
            for k, (ino, grad) in enumerate(singles, len(whole)):
                n.start_soon(partial(streams.client.training.push, ino, rank, grad, owner=owner, order=k))


@contextmanager
def _layout_held(streams: Streams) -> Iterator[None]:
    """A push of a step refused because the model's layout changed under it (LAYOUT_CHANGED: a
    tensor packed or unpacked through another mount since this mount laid the model out) is EIO,
    not ESTALE: other tensors of the same step may have been taken already, and a door's client
    opens the door again on ESTALE and repeats the step, which would push those twice. The
    layout is laid out afresh for the next step."""
    try:
        yield
    except BaseException as exc:
        if not any(isinstance(e, RemoteError) and e.code == LAYOUT_CHANGED for e in leaves(exc)):
            raise
        streams.layouts.forget()
        log.warning("a step's push met a layout changed under it; part of it may have been taken: EIO, not repeated")
        why = "the model's layout changed under this step (packed or unpacked through another mount): part of it may have been taken"
        raise FsError(errno.EIO, why) from exc


async def _whole_buckets(streams: Streams, model: int, pushes: dict) -> tuple[Layout, list[Bucket]]:
    """The layout to push ``pushes`` by, and the buckets they cover whole. A bucket they cover
    in part (a partial step: frozen layers, a door's ``only``) is unpacked first, so its tensors
    train alone from now on (B3: a bucket stripe is pushed whole or not at all; zeros are not
    "no push" under Adam or momentum); nothing has been pushed yet then."""
    layout = await streams.layouts.get(model)
    split = [b for b in layout.buckets if 0 < sum(e.name in pushes for e, _, _ in b.members) < len(b.members)]
    if split:
        for b in split:
            await streams.client.buckets.unpack(b.fid)
        streams.layouts.forget()
        layout = await streams.layouts.get(model)
    return layout, [b for b in layout.buckets if any(e.name in pushes for e, _, _ in b.members)]


async def _push_bucket(streams: Streams, rank: int, b: Bucket, step: tuple, order: int, early: bool = False) -> None:
    """The gradients of a bucket's members pushed as the bucket's, against the bucket's version
    as laid out (B2). ``step``: the step's (pushes by name, pushed bytes, their owner, the
    layout's header). Where the pushed bytes are the layout's own stream, which holds the
    members back to back in the bucket's order (``Bucket.direct``), pushed as they lie; else
    gathered into one. ``early``: a pull follows at once (``PushPull.push``)."""
    pushes, data, owner, header = step
    if b.direct is not None and data[: len(header)] == header:
        grad = np.frombuffer(data, b.dtype, b.count, offset=b.direct)
    else:
        grad = owner = np.zeros(b.count, b.dtype)  # (a range no member holds any more: nobody reads it)
        for e, _, at in b.members:
            g = pushes[e.name][1].reshape(-1)
            grad[at : at + g.size] = g
    try:
        await streams.client.training.push(b.fid, rank, grad, owner=owner, order=order, layout=b.version, early=early)
    except RemoteError as exc:
        if exc.code == "ENOENT":  # freed since it was laid out (its tensors unpacked elsewhere)
            raise RemoteError(LAYOUT_CHANGED, f"bucket {b.fid} is gone: {exc.message}") from None
        raise


async def _pull_bucket(streams: Streams, rank: int, layout: Layout, buf: memoryview, b: Bucket) -> None:
    """A bucket pulled as the policy lets ``rank`` see it, and its members' parameters put in
    their places in ``buf``; ESTALE if the bucket is no longer as laid out."""
    training = streams.client.training
    info = await training.train_info(b.fid, rank)
    if info["attr"]["version"] != b.version:  # the layout may be the newer one: ask again
        training.forget_training(b.fid)
        info = await training.train_info(b.fid, rank)
    if info["attr"]["version"] != b.version:
        streams.layouts.forget()
        raise FsError(errno.ESTALE, f"bucket {b.fid} changed since the step was laid out: open the stream again")
    if b.direct is not None:  # in place
        await training.pull_into(b.fid, rank, np.frombuffer(buf, b.dtype, b.count, offset=b.direct), info)
        return
    out = np.empty(b.count, b.dtype)
    await training.pull_into(b.fid, rank, out, info)
    for e, _, at in b.members:
        dst = _param(layout, buf, e)
        dst[:] = out[at : at + dst.size]


def _small(layout: Layout) -> tuple[list, list]:
    """The parts of ``layout`` pulled together (``_pull_group``), and the others."""
    apart = layout.apart
    return [(e, a) for e, a in apart if e.end - e.begin <= GROUP_BYTES], [(e, a) for e, a in apart if e.end - e.begin > GROUP_BYTES]


async def pull_stream(streams: Streams, rank: int, layout: Layout, buf: memoryview) -> None:
    """Every parameter of ``layout`` as ``rank`` may see it now, into ``buf`` (at least the
    stream's size; its header is the caller's), concurrently: the small ones together."""
    small, large = _small(layout)
    with single_exception(alike=FsError):  # every tensor changed alike: one ESTALE
        async with trio.open_nursery() as n:
            for b in layout.buckets:
                n.start_soon(_pull_bucket, streams, rank, layout, buf, b)
            if small:
                n.start_soon(_pull_group, streams, rank, layout, buf, small)
            for e, attr in large:
                n.start_soon(_pull_one, streams, rank, layout, buf, e, attr)


async def step_stream(
    streams: Streams, rank: int, model: int, data: memoryview, layout: Layout, buf: memoryview, *, owner: object, only: set[str] | None = None
) -> None:
    """A push and the pull after it, overlapped: each tensor's pull starts as soon as its own
    push is taken, so while later tensors are still being pushed, earlier ones (their rounds
    closed) are already coming back. Same checks and results as ``push_stream`` then
    ``pull_stream``; on a network, pushes fill the nodes' inbound links while pulls use their
    outbound ones (BytePS overlaps a step the same way). Every worker sends its pushes in the
    model's order (the small ones first, then the stream's), whatever order the scheduler
    runs their tasks in, so a round closes as soon as its tensor came from every rank."""
    pushes = await _validate(streams, rank, model, data, only)
    now, whole = await _whole_buckets(streams, model, pushes)
    if now.header != layout.header:
        raise FsError(errno.ESTALE, "the model's tensors changed since the stream was laid out: open it again")
    layout = now
    small, large = _small(layout)
    # the buckets first, then the small ones (their pulls go together), then the large
    place = {e.name: k for k, (e, _) in enumerate(small + large, len(layout.buckets))}

    def push(e):  # every worker sends a step's pushes in this order (PushPull.push); its pull follows
        ino, grad = pushes[e.name]
        return streams.client.training.push(ino, rank, grad, owner=owner, order=place[e.name], early=True)

    async def one(e, attr) -> None:
        if e.name in pushes:
            await push(e)
        await _pull_one(streams, rank, layout, buf, e, attr)

    pushed = [e for e, _ in small if e.name in pushes]
    left = [len(pushed)]
    all_pushed = trio.Event()

    async def push_small(e) -> None:  # started beside the large ones: their order is one
        await push(e)
        left[0] -= 1
        if not left[0]:
            all_pushed.set()

    async def together(parts: list) -> None:  # the small ones: pushed, then pulled in bursts
        if pushed:
            await all_pushed.wait()
        await _pull_group(streams, rank, layout, buf, parts)

    async def bucket(k: int, b: Bucket) -> None:
        if b in whole:
            await _push_bucket(streams, rank, b, (pushes, data, owner, layout.header), k, early=True)
        await _pull_bucket(streams, rank, layout, buf, b)

    with _layout_held(streams), single_exception(alike=FsError):
        async with trio.open_nursery() as n:
            for k, b in enumerate(layout.buckets):
                n.start_soon(bucket, k, b)
            for e in pushed:
                n.start_soon(push_small, e)
            if small:
                n.start_soon(together, small)
            for e, attr in large:
                n.start_soon(one, e, attr)


async def _pull_group(streams: Streams, rank: int, layout: Layout, buf: memoryview, parts: list) -> None:
    """The parameters ``parts`` of a pull stream in one ``PushPull.pull_many`` (stripes read in
    bursts per node); one whose tensor no longer fits its entry goes through ``_pull_one``
    (asked again, or ESTALE)."""
    training = streams.client.training
    together, apart = [], []
    for e, attr in parts:
        t = (await training.train_info(attr["ino"], rank))["tensor"]
        if _fits(t, e):
            together.append((attr["ino"], _param(layout, buf, e)))
        else:
            apart.append((e, attr))
    async with trio.open_nursery() as n:
        n.start_soon(training.pull_many, rank, together)
        for e, attr in apart:
            n.start_soon(_pull_one, streams, rank, layout, buf, e, attr)


def _fits(t: dict, e) -> bool:
    """Whether tensor info ``t`` is what stream entry ``e`` says (dtype and shape)."""
    return list(t["shape"]) == list(e.shape) and np.dtype(t["dtype"]) == np.dtype(e.dtype)


async def _pull_one(streams: Streams, rank: int, layout: Layout, buf: memoryview, e, attr: dict) -> None:
    """Parameter ``e`` of a pull stream into its place in ``buf``. ESTALE if the tensor is no
    longer what the layout says: the model was published again with other shapes through
    another mount (this mount's layout is cached; the tensor's info is at most TRAIN_INFO_TTL
    old, and fetched again when the two disagree), and its bytes read by the old layout would
    be the new tensor cut or padded."""
    training = streams.client.training
    t = (await training.train_info(attr["ino"], rank))["tensor"]
    if not _fits(t, e):  # the layout may be the newer one (read again for a door): ask again
        training.forget_training(attr["ino"])
        t = (await training.train_info(attr["ino"], rank))["tensor"]
    if not _fits(t, e):
        streams.layouts.forget()
        now, was = f"{np.dtype(t['dtype'])}{list(t['shape'])}", f"{np.dtype(e.dtype)}{list(e.shape)}"
        raise FsError(errno.ESTALE, f"tensor {e.name!r} is {now} now, not {was}: open the stream again")
    await streams.client.training.pull_into(attr["ino"], rank, _param(layout, buf, e))


def _param(layout: Layout, buf: memoryview, e) -> np.ndarray:
    """Where entry ``e`` of a pull stream laid out as ``layout`` lives in ``buf``."""
    count = (e.end - e.begin) // np.dtype(e.dtype).itemsize
    return np.frombuffer(buf, e.dtype, count, offset=len(layout.header) + e.begin)


async def _validate(streams: Streams, rank: int, model: int, data: memoryview, only: set[str] | None = None) -> dict[str, tuple[int, np.ndarray]]:
    """name -> (tensor inode, gradient view) for every entry (those named in ``only``, each of
    which must be one), or EINVAL naming what is wrong."""
    end = len(data)
    layout = await streams.layouts.get(model)
    if end >= layout.size and data[: len(layout.header)] == layout.header and only is None:
        # the model's own stream (a door's push area, push_arrays' stream): checked once per layout
        base = len(layout.header)
        return {e.name: (a["ino"], np.frombuffer(data, e.dtype, (e.end - e.begin) // np.dtype(e.dtype).itemsize, offset=base + e.begin).reshape(e.shape))
                for e, a in layout.parts}  # fmt: skip
    try:
        if end < 8:
            raise formats.SafetensorsError("shorter than the 8-byte header length")
        n = int.from_bytes(data[:8], "little")
        start, entries, _ = formats.st_parse(bytes(data[: min(end, 8 + n)]), end)
        known = layout.by_name()
        if any(e.name not in known for e in entries):
            known = (await streams.layouts.get(model, fresh=True)).by_name()
        out = {}
        for e in entries:  # (st_parse refuses a name given twice)
            if e.name not in known:
                raise formats.SafetensorsError(f"tensor {e.name!r} is not in this model")
            want, attr = known[e.name]
            if (np.dtype(e.dtype), e.shape) != (np.dtype(want.dtype), want.shape):
                holds = f"{np.dtype(want.dtype)}{list(want.shape)}"
                raise formats.SafetensorsError(f"tensor {e.name!r}: pushed {np.dtype(e.dtype)}{list(e.shape)}, the model holds {holds}")
            count = (e.end - e.begin) // np.dtype(e.dtype).itemsize
            grad = np.frombuffer(data, e.dtype, count, offset=start + e.begin).reshape(e.shape)
            out[e.name] = (attr["ino"], grad)
        unknown = set() if only is None else only - set(out)
        if unknown:
            raise formats.SafetensorsError(f"tensor {sorted(unknown)[0]!r} is not in this model")
    except formats.SafetensorsError as exc:
        log.warning("push stream of rank %d to directory %d refused: %s", rank, model, exc)
        raise FsError(errno.EINVAL, str(exc)) from None
    return out if only is None else {name: p for name, p in out.items() if name in only}


@dataclass
class PushStreamHandle:
    """``.workers/<rank>/<model>.safetensors`` opened for writing: one step's gradients."""

    ino: int
    streams: Streams
    rank: int
    model: int
    buf: bytearray = field(default_factory=bytearray)
    end: int = 0  # bytes written so far reach this offset
    dirty: bool = False
    direct: bool = True

    async def read(self, off: int, size: int) -> memoryview:
        raise FsError(errno.EBADF)

    async def prepare(self) -> None:
        """Start from the buffer of the last step (a stream is usually the model's size)."""
        try:
            size = (await self.streams.layouts.get(self.model)).size
        except Exception:  # noqa: BLE001 -- a model that cannot be laid out is refused at flush
            size = 0
        self.buf = self.streams.layouts.take("push", self.rank, self.model, size)

    async def write(self, off: int, data: bytes) -> int:
        end = off + len(data)
        if end > len(self.buf):
            # grow geometrically; a stream is usually one model's size, known from the last step
            grown = self.streams.layouts.take("push", self.rank, self.model, max(end, 2 * len(self.buf)))
            grown[: self.end] = self.buf[: self.end]
            self.buf = grown
        memoryview(self.buf)[off:end] = data  # (a bytearray slice assigned bytes copies them twice)
        self.end = max(self.end, end)
        self.dirty = True
        return len(data)

    async def flush(self) -> None:
        if not self.dirty:
            return
        await push_stream(self.streams, self.rank, self.model, memoryview(self.buf)[: self.end], owner=self.buf)
        self.dirty = False  # only once pushed: a failed flush fails again at close
        self.end = 0

    async def fsync(self) -> None:
        await self.flush()
        for ino in self.streams.client.training.pushed_tensors(self.rank):
            await self.streams.client.training.wait_applied(ino, self.rank)

    def close(self) -> None:
        self.streams.layouts.give_back("push", self.rank, self.model, self.buf)


@dataclass
class PullStreamHandle:
    """``.workers/<rank>/<model>.safetensors`` opened for reading: every parameter, pulled at
    open as the model's policy lets ``rank`` see them."""

    ino: int
    streams: Streams
    rank: int
    model: int
    buf: bytearray = field(default_factory=bytearray)
    size: int = 0
    direct: bool = True

    async def pull(self) -> None:
        layout = await self.streams.layouts.get(self.model)
        self.size = layout.size
        self.buf = self.streams.layouts.take("pull", self.rank, self.model, self.size)
        self.buf[: len(layout.header)] = layout.header
        await pull_stream(self.streams, self.rank, layout, memoryview(self.buf)[: self.size])

    async def read(self, off: int, size: int) -> memoryview:
        return memoryview(self.buf)[off : min(off + size, self.size)]

    async def write(self, off: int, data: bytes) -> int:
        raise FsError(errno.EBADF)

    async def flush(self) -> None:
        pass

    async def fsync(self) -> None:
        pass

    def close(self) -> None:
        self.streams.layouts.give_back("pull", self.rank, self.model, self.buf)
