"""The runs' per-step captures, read from disk when a step is needed, a few at a time.

Every rank writes one file per step (:func:`ddplab.compare.runners.capture_path`).
The parent judges a comparison step by step, so it needs only a handful of
captures at once: the current step of each rank and of the reference runs,
and the step before it (the replay starts each step from the state the
rank left). :class:`Captures` is one rank's steps of one run as a sequence
that reads a step when it is indexed; every sequence of a comparison shares
one :class:`CaptureCache`, which keeps the last few captures read and forgets
the rest. The parent's memory then grows with the model and the number of
ranks, not with the number of steps.

Both sides reuse memory the process touched already, because new memory is
the dearest part of moving a capture (:mod:`ddplab.compare.memory`; a 200 MB
capture written into a new file's pages took 0.48 s here, over a file's
cached pages 0.02 s). A rank writes a step over
the file of a step nobody reads any more (:func:`recycle_capture`), and the
parent reads a rank's captures into the storages its earlier ones no longer
use (:class:`ReadBuffers`).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import io
import math
import os
import shutil
import zipfile
from collections.abc import Callable, Iterator, Sequence

import torch

from ddplab.compare.memory import drop_pages

__all__ = ["CaptureCache", "ReadBuffers", "Captures", "SPARE_BYTES", "StepRecords", "in_step", "save_capture",
           "read_capture", "capture_size", "PACKED_NUMEL", "has_step", "common_steps", "bits_view", "same_bits",
           "Scaled", "SameAs", "same_as", "large_tensors", "resolve_same_as", "RecentSteps", "InitialWeights",
           "initial_weights", "recycle_capture", "remove_recycled"]

#: Tensors of at most this many elements are packed into one buffer per dtype when a capture is
#: written: a capture holds hundreds of small tensors (a parameter's gradient, a collective's inputs),
#: and reading each as a storage of its own costs more than its bytes.
PACKED_NUMEL = 1 << 16
_PACKED = "__ddplab_packed__"


def _walk(x, leaf):
    """``x`` with every leaf (a packed tensor's marker, or what is not a dict, list or plain tuple)
    replaced by ``leaf(value)``."""
    if isinstance(x, dict):
        return {k: _walk(v, leaf) for k, v in x.items()}
    if type(x) in (list, tuple) and not _is_packed(x):
        return type(x)(_walk(v, leaf) for v in x)
    return leaf(x)


def _is_packed(x) -> bool:
    return type(x) is tuple and len(x) == 4 and x[0] == _PACKED


def _packable(x) -> bool:
    return isinstance(x, torch.Tensor) and x.numel() <= PACKED_NUMEL and x.layout == torch.strided


#: The integer dtype of each element size: what a tensor is viewed as to compare it bit by bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(x: torch.Tensor) -> torch.Tensor | None:
    """``x``'s elements as integers of their size (a view, whatever its strides), or None for a tensor
    that is never merged with another (a subclass, a meta, quantized, conjugated or negated view)."""
    # Bits, not values: as floats -0.0 == 0.0 and NaN != NaN, yet a capture must give back exactly what
    # was written (the comparison tells -0.0 from 0.0 and one NaN payload from another), and a NaN
    # tensor written three times is still one tensor's bytes.
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided or x.is_meta \
            or x.is_quantized or x.is_conj() or x.is_neg():
        return None
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)           # complex128 has no 16-byte integer: its two float64 halves
    dtype = _BITS.get(x.element_size())
    if dtype is None:
        return None
    try:
        return x.view(dtype)                # same element size: a view, no copy, any strides
    except RuntimeError:
        return None


def _probe(bits: torch.Tensor) -> tuple:
    """The bits of a few elements (first, middle, last): two tensors that differ there are not
    compared whole, so a capture of many distinct tensors of one shape costs no pairwise scans."""
    picked = []
    for k in (0, bits.numel() // 2, bits.numel() - 1):
        index = []
        for size in reversed(bits.shape):   # the k-th element in row-major order, whatever the strides
            k, i = divmod(k, size)
            index.append(i)
        picked.append(bits[tuple(reversed(index))])
    return tuple(torch.stack(picked).tolist())   # one transfer (one sync on a GPU)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` hold the same dtype, shape and bits (:func:`bits_view`)?"""
    x, y = bits_view(a), bits_view(b)
    return x is not None and y is not None and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(x, y))


def _twins(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """For each large tensor of ``tensors`` (distinct objects) whose bits an earlier one repeats:
    ``id(tensor) -> the earlier one``. Tensors are compared whole only within a group of the same
    type, dtype, shape, device, requires_grad and probed bits."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    same: dict[int, torch.Tensor] = {}
    for x in tensors:
        bits = bits_view(x)
        if bits is None:
            continue
        # type and requires_grad too: the tensor stored in a twin's place is what reads back there
        key = (type(x), x.dtype, x.shape, x.device, x.requires_grad, _probe(bits))
        kept = groups.setdefault(key, [])
        for kept_bits, first in kept:
            if torch.equal(bits, kept_bits):    # integers: equal exactly when the bits are
                same[id(x)] = first
                break
        else:
            kept.append((bits, x))
    return same


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A tensor of a capture written as another one times a scalar: ``base.mul(factor)`` (DDP's all-reduce
    input is its bucket times 1/W). Only ``base``'s bytes are written, and it reads back as a Scaled
    (:func:`read_capture`): :meth:`value` computes the product when it is used, the same bits :meth:`of`
    checked when it was made."""

    base: torch.Tensor
    factor: float

    def value(self) -> torch.Tensor:
        return self.base.mul(self.factor)

    @classmethod
    def of(cls, x: torch.Tensor, base: torch.Tensor, factor: float) -> "Scaled | None":
        """``x`` as ``base`` times ``factor`` when that product holds ``x``'s bits, else None."""
        if base.dtype != x.dtype or base.shape != x.shape or base.device != x.device or bits_view(x) is None:
            return None
        if bits_view(base) is None:
            return None
        # A block at a time: the product is compared, never held whole (a model size less in a rank).
        flat_x, flat_base = x.detach().reshape(-1), base.detach().reshape(-1)
        for start in range(0, max(1, flat_x.numel()), _SCALED_BLOCK):
            piece = flat_base[start:start + _SCALED_BLOCK].mul(factor)
            if not same_bits(piece, flat_x[start:start + _SCALED_BLOCK]):
                return None
        return cls(base, factor)


#: Elements of :meth:`Scaled.of`'s product computed at a time.
_SCALED_BLOCK = 1 << 20


def initial_weights(module: torch.nn.Module) -> torch.Tensor | None:
    """The model's trainable parameters flattened one after another, as one tensor (None when they are
    not all of one floating dtype): what DDP broadcasts from rank 0 when it wraps the model, before any
    step. Every rank and the parent build these bits (checked by digest before any step)."""
    from ddplab.compare.setup import named_trainable

    params = [p.detach().reshape(-1) for _, p in named_trainable(module)]
    if not params or len({p.dtype for p in params}) != 1 or not params[0].is_floating_point():
        return None
    return torch.cat(params)


@dataclasses.dataclass(frozen=True)
class InitialWeights:
    """A tensor of a capture whose bits are elements ``offset .. offset + numel`` of the model's
    :func:`initial_weights` (DDP's broadcast of them when it wraps the model): written as this marker, read
    back by whoever holds the initial weights (:meth:`value`). The rank compared the bits when it wrote it."""

    offset: int
    numel: int

    def value(self, initial: torch.Tensor) -> torch.Tensor:
        return initial[self.offset:self.offset + self.numel]

    @staticmethod
    def mark(collectives: list[dict], initial: torch.Tensor) -> None:
        """Write every large tensor of ``collectives`` (recorded states, in issue order) that holds a run of
        ``initial``'s bits as an :class:`InitialWeights`, in place. A broadcast's input and output hold the
        same run, and its next bucket the run after it: those places are tried, and the start."""
        bits, tried = bits_view(initial), {0}
        for state in collectives:
            for key, tensors in (state.get("tensors") or {}).items():
                for i, t in enumerate(tensors):
                    if not isinstance(t, torch.Tensor) or _packable(t) or t.dtype != initial.dtype \
                            or t.dim() != 1 or t.numel() > initial.numel() or bits_view(t) is None:
                        continue
                    for offset in sorted(tried):
                        if offset + t.numel() <= initial.numel() and torch.equal(
                                bits_view(t), bits[offset:offset + t.numel()]):
                            tensors[i] = InitialWeights(offset, t.numel())
                            tried.add(offset + t.numel())
                            break


@dataclasses.dataclass(frozen=True)
class SameAs:
    """A tensor of a rank's capture that holds the same bits as rank 0's at the same place of its capture
    of the same step (``key``: the keys and indices that lead there): written as this reference, read
    back as rank 0's tensor (:class:`CaptureCache`). DDP's ranks hold the same parameters and reduced
    gradients: W-1 copies of them are never written."""

    key: tuple


def _at(data, key: tuple):
    for k in key:
        data = data[k]
    return data


def large_tensors(data) -> bool:
    """Does ``data`` hold a tensor that :func:`save_capture` writes on its own (beyond :data:`PACKED_NUMEL`)?"""
    found = []
    _walk(data, lambda x: found.append(True) if isinstance(x, torch.Tensor) and not _packable(x) else None)
    return bool(found)


def same_as(data: dict, other: dict) -> dict:
    """``data`` with every large tensor that holds the bits of ``other``'s tensor at the same place
    replaced by :class:`SameAs` (``other``: rank 0's capture of the same step)."""

    def walk(x, key):
        if isinstance(x, dict):
            return {k: walk(v, key + (k,)) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(walk(v, key + (i,)) for i, v in enumerate(x))
        if not isinstance(x, torch.Tensor) or _packable(x) or bits_view(x) is None:
            return x
        try:
            theirs = _at(other, key)
        except (KeyError, IndexError, TypeError):
            return x
        if not isinstance(theirs, torch.Tensor) or bits_view(theirs) is None or theirs.shape != x.shape \
                or theirs.dtype != x.dtype or _probe(bits_view(theirs)) != _probe(bits_view(x)):
            return x
        return SameAs(key) if same_bits(x, theirs) else x

    return walk(data, ())


def resolve_same_as(data, other: Callable[[], dict]):
    """``data`` with every :class:`SameAs` replaced by ``other()``'s tensor at its key."""
    return _walk(data, lambda x: _at(other(), x.key) if isinstance(x, SameAs) else x)


def _packed(data: dict) -> tuple[dict, int]:
    """What :func:`save_capture` writes of ``data`` -- every small tensor (:data:`PACKED_NUMEL`) a slice of one
    buffer per dtype, each distinct large tensor once -- and the bytes of its tensors."""
    small: list[torch.Tensor] = []
    large: list[torch.Tensor] = []
    seen: set[int] = set()                  # a tensor object met again is stored once, never compared

    def sort(x):
        if isinstance(x, Scaled):
            x = x.base
        if isinstance(x, torch.Tensor) and id(x) not in seen:
            seen.add(id(x))
            (small if _packable(x) else large).append(x)

    _walk(data, sort)
    # torch.save writes each storage once, so a twin written as the first tensor costs no bytes
    same = _twins(large)
    sizes: dict[torch.dtype, int] = collections.Counter()
    for t in small:
        sizes[t.dtype] += t.numel()
    buffers = {dtype: torch.empty(n, dtype=dtype) for dtype, n in sizes.items()}
    used: dict[torch.dtype, int] = collections.Counter()
    markers: dict[int, tuple] = {}

    def pack(x):
        if isinstance(x, Scaled):
            return Scaled(pack(x.base), x.factor)
        if not isinstance(x, torch.Tensor):
            return x
        if not _packable(x):
            return same.get(id(x), x)
        if id(x) not in markers:
            start = used[x.dtype]
            used[x.dtype] = start + x.numel()
            buffers[x.dtype][start:start + x.numel()].copy_(x.detach().reshape(-1))
            markers[id(x)] = (_PACKED, str(x.dtype).removeprefix("torch."), start, tuple(x.shape))
        return markers[id(x)]

    skeleton = _walk(data, pack)
    needed = sum(b.numel() * b.element_size() for b in buffers.values()) + sum(
        t.untyped_storage().nbytes() for t in large if id(t) not in same)
    return {_PACKED: {str(d).removeprefix("torch."): b for d, b in buffers.items()}, "data": skeleton}, needed


def save_capture(data: dict, path: str, kind: str | None = None) -> None:
    """Write ``data`` (dicts, lists and tuples of tensors and plain values) to ``path`` atomically:
    every small tensor (:data:`PACKED_NUMEL`) a slice of one buffer per dtype, and the bytes of each
    distinct large tensor once (a tensor object met twice, or large tensors of the same dtype, shape
    and bits: DDP's bucket, its hook's result and the all-reduce's output are often three clones); a
    :class:`Scaled` costs no bytes beyond its base's. ``kind``: write over a capture of that kind in
    the folder that :func:`recycle_capture` kept, where there is one."""
    payload, needed = _packed(data)
    tmp = path + ".tmp"
    try:
        with _without_crc32():
            if kind is not None and _take_recycled(os.path.dirname(path), kind, tmp):
                with open(tmp, "r+b") as f:   # not "wb": truncating would free the pages it reuses
                    torch.save(payload, f)
                    f.truncate()
            else:
                torch.save(payload, tmp)
    except (OSError, RuntimeError) as exc:
        free = shutil.disk_usage(os.path.dirname(path) or ".").free
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)   # a partial capture holds the room the next one needs
        # torch.save says only "unexpected pos" when the disk fills: say what it is.
        if (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or free < needed:
            raise OSError(errno.ENOSPC, f"No space left on device for a capture of {needed} bytes "
                                        f"({free} bytes free)", path) from exc
        raise
    os.replace(tmp, path)  # a capture that exists is complete


#: What a kept capture's name starts with (:func:`recycle_capture`); never a capture's own name.
_RECYCLED = "recycled-"


def recycle_capture(path: str, kind: str) -> None:
    """Keep the capture at ``path``, which nobody reads any more, for the next :func:`save_capture` of
    the same ``kind`` in its folder to write over, instead of deleting it. Its pages are in memory:
    writing over them is a copy, where a new file's pages are allocated first (see the module
    docstring). The same kind -- a run's rank -- writes about as many bytes each step, so few pages
    are freed or added."""
    folder, name = os.path.split(path)
    os.replace(path, os.path.join(folder, f"{_RECYCLED}{kind}-{name}"))


def _take_recycled(folder: str, kind: str, into: str) -> bool:
    """Rename a capture of ``kind`` kept in ``folder`` to ``into``; False when there is none."""
    prefix = f"{_RECYCLED}{kind}-"
    for name in os.listdir(folder):
        if name.startswith(prefix):
            try:
                os.rename(os.path.join(folder, name), into)
                return True
            except FileNotFoundError:   # deleted meanwhile (the pass is closing)
                continue
    return False


def remove_recycled(folder: str) -> None:
    """Delete the captures kept in ``folder`` for writing over."""
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith(_RECYCLED):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save without the archive's CRC-32 of every record, then as the process had it: a capture
    lives seconds in a private folder, torch.load does not check the CRC, and computing it cost a rank
    a third of the time it spends writing (measured: 0.089 s against 0.057 s for 200 MB)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class _Counted(io.RawIOBase):
    """A file that keeps nothing and counts the bytes written to it."""

    def __init__(self):
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.count += len(b)
        return len(b)


def capture_size(data: dict) -> int:
    """The bytes :func:`save_capture` writes for ``data``, counted without writing them (a few bytes
    fewer: the archive's name inside the file is the file's)."""
    sink = _Counted()
    with _without_crc32():
        torch.save(_packed(data)[0], sink)
    return sink.count


def read_capture(path: str, mmap: bool = True, into: "ReadBuffers | None" = None) -> dict:
    """What :func:`save_capture` wrote to ``path`` (memory-mapped: only the parts read are loaded;
    ``into``: copied into its storages instead, the file unmapped when this returns).
    Tensors may share memory: small ones are views of one buffer per dtype, and every place a large
    tensor's bits were written holds one tensor, so callers must not modify what they read in place.
    Files this comparison's own ranks wrote into its private scratch folder: trusted, so read with the
    plain unpickler (the weights-only one is several times slower on many small records)."""
    if into is not None:
        into.expect(_storage_sizes(path))
        stored = torch.load(path, weights_only=False, mmap=True, map_location=into.copy_of)
    else:
        stored = torch.load(path, weights_only=False, mmap=mmap)
    if not (isinstance(stored, dict) and _PACKED in stored):
        return stored                      # a plain torch.save of a dict
    buffers = stored[_PACKED]

    def unpack(x):
        if isinstance(x, Scaled):
            return Scaled(unpack(x.base), x.factor)
        if not _is_packed(x):
            return x
        _, dtype, start, shape = x
        return buffers[dtype][start:start + math.prod(shape)].view(shape)

    return _walk(stored["data"], unpack)


#: What an evidence source yields: its records of each step in turn, one list per step (then, at most,
#: one list more: what it concludes once every step is seen).
StepRecords = Iterator[list]


def in_step(*sources: StepRecords, judged: Callable[[int], None] | None = None) -> list[list[dict]]:
    """Each source's records, the sources advanced together one step at a time: the captures of a
    step are read once, while the cache holds them, and every source has used them before the next
    step is read. A source that ends early drops out. ``judged(step)`` is called once every source
    has had that step (:meth:`ddplab.compare.streaming.Pass.judged`)."""
    out: list[list[dict]] = [[] for _ in sources]
    live = dict(enumerate(sources))
    step = 0
    while live:
        for index, source in list(live.items()):
            try:
                out[index] += next(source)
            except StopIteration:
                del live[index]
        if judged is not None:
            judged(step)
        step += 1
    return out


def has_step(captures: Sequence, step: int) -> bool:
    """Does ``captures`` have step ``step``? A sequence that is still being written
    (:class:`ddplab.compare.streaming.LiveCaptures`) waits to know."""
    has = getattr(captures, "has", None)
    return has(step) if has is not None else 0 <= step < len(captures)


def common_steps(*captures: Sequence) -> Iterator[int]:
    """Steps 0, 1, ... while every one of ``captures`` has the step (:func:`has_step`)."""
    step = 0
    while all(has_step(c, step) for c in captures):
        yield step
        step += 1


class ReadBuffers:
    """The storages one rank's captures are read into (:func:`read_capture`), each large one read into again
    by a later capture once no tensor holds it: memory the process has touched is a copy away, where new
    memory is faulted in page by page first (see the module docstring). Before each read (:meth:`expect`) the storages
    no tensor holds beyond what it needs, by size, are given back: what is kept is what the rank's
    captures still in memory hold and what the next read needs, never more than reading it anew."""

    #: Storages smaller than this are copied into new memory: reusing them saves little.
    MIN_BYTES = 1 << 20

    def __init__(self):
        self._kept: dict[int, list[torch.UntypedStorage]] = {}   # by size in bytes
        self._taken: set[int] = set()    # ids of the storages handed out by this read
        self.reused = 0

    def expect(self, sizes: list[int]) -> None:
        """A capture whose storages have these sizes in bytes is read next: keep as many unused storages
        of each size as it has, and give back the other unused ones."""
        wanted = collections.Counter(size for size in sizes if size >= self.MIN_BYTES)
        for size, kept in list(self._kept.items()):
            spare = wanted[size]
            mine = []
            for storage in kept:
                if not _unused(storage):
                    mine.append(storage)
                elif spare > 0:
                    mine.append(storage)
                    spare -= 1
            kept[:] = mine
            if not kept:
                del self._kept[size]
        self._taken.clear()

    def copy_of(self, storage: torch.UntypedStorage, location: str = "cpu") -> torch.UntypedStorage:
        """A storage of this process holding ``storage``'s bytes (a ``torch.load`` ``map_location``)."""
        size = storage.nbytes()
        if size < self.MIN_BYTES:
            return storage.clone()
        kept = self._kept.setdefault(size, [])
        into = next((s for s in kept if id(s) not in self._taken and _unused(s)), None)
        if into is None:
            into = torch.UntypedStorage(size)
            kept.append(into)
        else:
            self.reused += 1
        self._taken.add(id(into))
        _copy_from_mapping(into, storage)
        return into

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())


def _storage_sizes(path: str) -> list[int]:
    """The bytes of each storage ``torch.save`` wrote to ``path`` (its archive's ``data/`` records)."""
    with zipfile.ZipFile(path) as archive:
        return [info.file_size for info in archive.infolist() if "/data/" in info.filename]


#: Bytes :func:`_copy_from_mapping` copies before it drops the pages it read.
_MAPPED_CHUNK = 8 * 2**20


def _copy_from_mapping(into: torch.UntypedStorage, mapped: torch.UntypedStorage) -> None:
    """``into.copy_(mapped)`` a chunk at a time, dropping each chunk's pages of ``mapped`` (a slice of a
    file ``torch.load`` memory-mapped) once copied: the process's resident memory never holds the
    file's pages and their copy at once, only a chunk of them."""
    size = mapped.nbytes()
    for start in range(0, size, _MAPPED_CHUNK):
        stop = min(size, start + _MAPPED_CHUNK)
        into[start:stop].copy_(mapped[start:stop])
        drop_pages(mapped.data_ptr() + start, stop - start)


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unused(storage: torch.UntypedStorage) -> bool:
    """Does no tensor (nor any other storage object) hold ``storage``'s memory? Its one reference is
    the Python object ``storage`` itself (torch's own test of a storage's liveness, as inductor's
    cudagraph trees use it). A torch without that count says no: nothing is reused."""
    return _use_count is not None and _use_count(storage._cdata) == 1


#: Bytes of captures (as stored on disk) a cache keeps beyond its ``size`` most recent ones: a small
#: model's whole comparison is then read once, whatever order the evidence sources walk its steps.
SPARE_BYTES = 16 * 2**20


class CaptureCache:
    """The captures read last, by (run, rank, step): always the last ``size``, and older ones while all
    of them together stay within ``spare_bytes`` on disk; the rest are forgotten, except those pinned
    (:meth:`pin`, :meth:`keep_only`: their files may be deleted), which stay until :meth:`forget`. The
    memory held is then ``max(size captures, spare_bytes)`` and the steps pinned, whatever the number
    of steps."""

    def __init__(self, size: int, spare_bytes: int = SPARE_BYTES):
        if size < 1:
            raise ValueError(f"a capture cache holds at least one capture, got {size}")
        if spare_bytes < 0:
            raise ValueError(f"spare_bytes must be 0 or more, got {spare_bytes}")
        self.size, self.spare_bytes = size, spare_bytes
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._bytes: dict = {}
        self._pinned: set = set()   # captures whose file may be gone (pin, keep_only): kept until forgotten
        self.reads = 0
        self.buffers: dict[tuple, ReadBuffers] = {}   # by (root, run, rank): what its captures are read into

    def get(self, root: str, run_id: str, rank: int, step: int) -> dict:
        from ddplab.compare.runners import capture_path

        key = (root, run_id, rank, step)
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        self.reads += 1
        path = capture_path(root, run_id, step, rank)
        buffers = self.buffers.get((root, run_id, rank))
        if buffers is None:
            buffers = self.buffers[root, run_id, rank] = ReadBuffers()
        value = read_capture(path, into=buffers)
        if rank != 0:   # rank 0's tensors where this rank wrote SameAs: one tensor in memory for both
            value = resolve_same_as(value, lambda: self.get(root, run_id, 0, step))
        self._items[key] = value
        self._bytes[key] = os.path.getsize(path)
        while len(self._items) > self.size and sum(self._bytes.values()) > self.spare_bytes:
            oldest = next((k for k in self._items if k not in self._pinned), None)
            if oldest is None:
                break
            del self._items[oldest], self._bytes[oldest]
        return value

    def pin(self, root: str, run_id: str, rank: int, step: int) -> None:
        """Never evict this capture until :meth:`forget`: its file may be deleted now."""
        if (root, run_id, rank, step) in self._items:
            self._pinned.add((root, run_id, rank, step))

    def keep_only(self, run_id: str, step: int, keys) -> None:
        """Of ``run_id``'s captures of ``step``, keep only ``keys``: what a later step still reads (the
        replay starts the next step from this one's parameters and optimizer state). They stay until
        :meth:`forget`: their files may be deleted now."""
        for key in [k for k in self._items if k[1] == run_id and k[3] == step]:
            capture = self._items[key]
            for name in [name for name in capture if name not in keys]:
                del capture[name]   # in place: a source that still holds the capture holds only this
            self._pinned.add(key)

    def forget(self, run_id: str | None = None, before: int | None = None) -> None:
        """Drop every capture (of ``run_id`` only, when given; of its steps before ``before`` only), emptied
        in place: no source reads a forgotten capture again, and one that still holds it (a generator
        paused at its step) then holds nothing of its tensors."""
        for key in [k for k in self._items if (run_id is None or k[1] == run_id)
                    and (before is None or k[3] < before)]:
            self._items[key].clear()
            del self._items[key], self._bytes[key]
            self._pinned.discard(key)
        if before is None:   # no later step of these runs is read
            for key in [k for k in self.buffers if run_id is None or k[1] == run_id]:
                del self.buffers[key]


class RecentSteps:
    """The last ``keep`` steps of a run that trains in this process, as the sequence the sources walk
    (:func:`common_steps`): a step is there once :meth:`put`, and ``keep`` steps later it is dropped
    (localization's fit at a step reads the truth's step before)."""

    def __init__(self, steps: int, keep: int = 2):
        self.steps, self.keep, self._items = steps, keep, {}

    def put(self, step: int, capture: dict) -> None:
        self._items[step] = capture
        self._items.pop(step - self.keep, None)

    def judged(self, step: int, keys: tuple = ()) -> None:
        """``step`` is judged: keep of it only ``keys`` (what a later step reads; none: nothing), and nothing
        of the steps before it. What the run captured is then held no longer than something reads it."""
        kept = self._items.get(step)
        self._items = {step: {k: kept[k] for k in keys if k in kept}} if kept is not None and keys else {}

    def has(self, step: int) -> bool:
        return step in self._items

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict:
        return self._items[step]


class Captures(Sequence):
    """Rank ``rank``'s captures of run ``run_id``: steps 0 .. ``len - 1``, read through ``cache``."""

    def __init__(self, cache: CaptureCache, root: str, run_id: str, rank: int, length: int):
        self.cache, self.root, self.run_id, self.rank, self._len = cache, root, run_id, rank, length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, stride = index.indices(self._len)
            if start != 0 or stride != 1:
                raise IndexError("captures are sliced from step 0: captures[:n]")
            return Captures(self.cache, self.root, self.run_id, self.rank, stop)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"step {index} of {self._len} captured")
        return self.cache.get(self.root, self.run_id, self.rank, index)

    def __repr__(self) -> str:
        return f"Captures({self.run_id!r}, rank={self.rank}, steps={self._len})"
