"""Collating samples straight into a batch buffer (a shared-memory slot).

``default_collate`` builds per-sample tensors and then stacks them into a new
allocation.  When every sample has the same structure of fixed-shape leaves
(tensors, numpy arrays, Python and numpy numbers), the batch layout is known from the
first sample: each leaf becomes a ``[batch, *shape]`` region of one buffer, and
each sample is copied into its row as soon as it is prepared, in any order.
The result is what ``default_collate`` returns (same types, dtypes, shapes and
values: tuples become lists, namedtuples and dicts keep their type); a test
checks that.  A string (or bytes) leaf, which ``default_collate`` gathers
into a list (a file's path beside its image, a caption), is a leaf of kind
``"obj"`` with no bytes in the buffer: its values are kept in a list per
batch that travels with the batch's layout (:attr:`Layout.values`; only
where the caller asks, ``layout_of(..., objs=True)``).  Anything else
(``None``, ragged shapes, a custom ``collate_fn``) takes the copy path:
samples are kept and collated at the end.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

__all__ = ["Layout", "layout_of", "row_targets", "write_row", "build", "pack_payloads", "samples_of"]

_ALIGN = 64


class _Leaf:
    __slots__ = ("dtype", "shape", "offset", "nbytes", "kind")

    def __init__(self, dtype: torch.dtype, shape: tuple, kind: str) -> None:
        self.dtype = dtype
        self.shape = shape
        # "tensor", "numpy", "int", "float", "bool", "npscalar" (numpy's number or bool), "obj" (a str or
        # bytes: no bytes in the buffer)
        self.kind = kind
        self.offset = 0
        self.nbytes = 0


class Layout:
    """Where each leaf of a batch of ``batch_size`` samples lives in a buffer.

    Picklable and small: it travels with every batch message.  A layout
    with ``"obj"`` leaves is one batch's: :attr:`values` holds, per such
    leaf, the list of its rows' values (``None`` where not written yet).
    """

    __slots__ = ("template", "leaves", "batch_size", "nbytes", "values", "match")

    def __init__(self, template, leaves: list[_Leaf], batch_size: int, values: dict | None = None) -> None:
        self.template = template
        # what a sample's _flatten gives (a "pair" is a tuple sample, collated as one: timm's fast_collate)
        self.match = ("tuple", template[1]) if template[0] == "pair" else template
        self.leaves = leaves
        self.batch_size = batch_size
        self.values = values if values is not None else \
            {k: [None] * batch_size for k, leaf in enumerate(leaves) if leaf.kind == "obj"}
        off = 0
        for leaf in leaves:
            if leaf.kind == "obj":
                leaf.offset = leaf.nbytes = 0
                continue
            off = (off + _ALIGN - 1) // _ALIGN * _ALIGN
            leaf.offset = off
            per = int(np.prod(leaf.shape, dtype=np.int64)) * _itemsize(leaf.dtype)
            leaf.nbytes = per * batch_size
            off += leaf.nbytes
        self.nbytes = max(off, 1)

    def __getstate__(self):
        return (self.template, [(l.dtype, l.shape, l.kind) for l in self.leaves], self.batch_size, self.values)

    def __setstate__(self, state) -> None:
        template, leaves, bs, values = state
        self.__init__(template, [_Leaf(*x) for x in leaves], bs, values)

    def leaves_of(self, sample) -> list | None:
        """``sample``'s leaves when it has exactly this layout's structure and
        shapes, else None.  One flatten per sample, reused by :func:`write_row`."""
        try:
            leaves: list = []
            template = _flatten(sample, leaves, bool(self.values))
        except _Unsupported:
            return None
        if template != self.match or len(leaves) != len(self.leaves):
            return None
        try:
            if all(_same(x, l) for x, l in zip(leaves, self.leaves)):
                return leaves
        except _Unsupported:
            pass
        return None


class _Unsupported(Exception):
    pass


def _same(x, leaf: _Leaf) -> bool:
    """``x`` has ``leaf``'s dtype and shape (:func:`_describe`'s check, with a
    shortcut for the usual case: a plain CPU tensor where the leaf is one)."""
    if leaf.kind == "tensor" and type(x) is torch.Tensor:
        return x.layout == torch.strided and x.is_cpu and x.dtype == leaf.dtype and x.shape == leaf.shape
    if leaf.kind == "obj" or isinstance(x, (str, bytes)):
        return leaf.kind == "obj" and isinstance(x, (str, bytes))
    return _describe(x)[:2] == (leaf.dtype, leaf.shape)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _describe(x) -> tuple[torch.dtype | None, tuple, str]:
    if isinstance(x, (str, bytes)):
        return None, (), "obj"
    if isinstance(x, _NP_SCALARS):     # default_collate makes a tensor of their dtype (np.float64 is a float too)
        if x.dtype.kind not in "biufc":
            raise _Unsupported
        return torch.from_numpy(np.empty(0, dtype=x.dtype)).dtype, (), "npscalar"
    if isinstance(x, torch.Tensor):
        if x.is_sparse or x.layout != torch.strided or x.device.type != "cpu":
            raise _Unsupported
        return x.dtype, tuple(x.shape), "tensor"
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biufc":
            raise _Unsupported
        return torch.from_numpy(np.empty(0, dtype=x.dtype)).dtype, tuple(x.shape), "numpy"
    if isinstance(x, bool):
        return torch.bool, (), "bool"
    if isinstance(x, int):
        return torch.int64, (), "int"
    if isinstance(x, float):
        return torch.float64, (), "float"
    raise _Unsupported


_NP_SCALARS = (np.bool_, np.number)
_LEAVES = (torch.Tensor, np.ndarray, bool, int, float) + _NP_SCALARS
_NUMBERS = ("int", "float", "bool", "npscalar")     # leaves written through numpy views (row_targets)


def _flatten(x, leaves: list, objs: bool = False):
    """Structure template of ``x`` (hashable, comparable); leaves appended in
    order.  ``objs``: a str or bytes is a leaf too."""
    if isinstance(x, _LEAVES) or (objs and isinstance(x, (str, bytes))):
        leaves.append(x)
        return "*"
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return ("namedtuple", type(x), tuple(_flatten(v, leaves, objs) for v in x))
    if isinstance(x, tuple):
        return ("tuple", tuple(_flatten(v, leaves, objs) for v in x))
    if type(x) is list:
        return ("list", tuple(_flatten(v, leaves, objs) for v in x))
    if type(x) is dict:
        keys = tuple(x.keys())
        return ("dict", keys, tuple(_flatten(x[k], leaves, objs) for k in keys))
    raise _Unsupported


def layout_of(sample, batch_size: int, objs: bool = False, pair: bool = False) -> Layout | None:
    """The in-place layout for samples like ``sample``, or None (copy path).
    ``objs``: str and bytes leaves are gathered in lists that travel with
    the layout (a new layout per batch), as ``default_collate`` gathers
    them; else they take the copy path.  ``pair``: the layout of timm's
    ``fast_collate`` (:func:`is_fast_collate`) instead of
    ``default_collate``'s, for a sample that is a tuple of a uint8 image
    (an array or a CPU tensor) and an integer class index, whose batch it
    makes as a tuple of the images stacked as they are and the indices as
    int64 (every version of it); None for any other sample."""
    leaves: list = []
    try:
        template = _flatten(sample, leaves, objs)
        described = [_describe(x) for x in leaves]
    except _Unsupported:
        return None
    if not any(d[2] != "obj" for d in described):
        return None     # nothing for the buffer: default_collate's lists cost no more
    if pair:
        template = as_pair(template, described)
        if template is None:
            return None
    return Layout(template, [_Leaf(*d) for d in described], batch_size)


def as_pair(template, described) -> tuple | None:
    """The template of timm's ``fast_collate``'s batch for samples of
    ``template`` whose leaves are ``described`` ((dtype, shape, kind) each),
    where they are a plain tuple of a uint8 image (an array or a CPU
    tensor) and an integer class index; else None."""
    if template != ("tuple", ("*", "*")) or described[0][0] != torch.uint8 \
            or described[0][2] not in ("tensor", "numpy") or tuple(described[1][:2]) != (torch.int64, ()) \
            or described[1][2] not in ("int", "npscalar"):
        return None
    return ("pair", template[1])


def views(layout: Layout, buf: np.ndarray, rows: int | None = None) -> list[torch.Tensor]:
    """One tensor per leaf over ``buf`` (a uint8 numpy array), ``rows`` rows each."""
    n = layout.batch_size if rows is None else rows
    out = []
    for k, leaf in enumerate(layout.leaves):
        if leaf.kind == "obj":      # the batch's list (the same object, for write_row, until rows are given)
            vals = layout.values[k]
            out.append(vals if rows is None else vals[:n])
            continue
        per = leaf.nbytes // layout.batch_size if layout.batch_size else 0
        region = buf[leaf.offset:leaf.offset + per * n]
        t = torch.from_numpy(region).view(leaf.dtype) if per else torch.empty((0,), dtype=leaf.dtype)
        out.append(t.view((n,) + leaf.shape))
    return out


def row_targets(layout: Layout, targets: list[torch.Tensor]) -> list:
    """What :func:`write_row` writes through: ``targets`` (from :func:`views`),
    with a numpy view in place of each Python-number leaf (a numpy element
    store costs ~0.1 us, torch's ``t[row] = x`` several; same value and dtype:
    int64, float64 or bool)."""
    return [t.numpy() if leaf.kind in _NUMBERS else t
            for leaf, t in zip(layout.leaves, targets)]


def leaf_bytes(x, leaf: _Leaf) -> np.ndarray:
    """A sample's leaf (from :meth:`Layout.leaves_of`, so of ``leaf``'s dtype
    and shape) as the bytes a row of it holds: a uint8 view where it is
    contiguous already (any dtype, bfloat16 too), else one copy."""
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().view(-1).view(torch.uint8).numpy() if x.numel() else np.empty(0, np.uint8)
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    if leaf.kind == "npscalar":
        return np.asarray(x).reshape(1).view(np.uint8)
    return np.asarray([x], dtype={"int": np.int64, "float": np.float64, "bool": np.bool_}[leaf.kind]).view(np.uint8)


def write_row(targets: list, row: int, leaves: list) -> None:
    """Copy a sample's leaves (from :meth:`Layout.leaves_of`) into row ``row``
    of ``targets`` (from :func:`views` or :func:`row_targets`)."""
    for t, x in zip(targets, leaves):
        if isinstance(x, torch.Tensor):
            t[row].copy_(x)
        elif isinstance(x, np.ndarray):
            t[row].copy_(torch.from_numpy(np.ascontiguousarray(x)))
        elif isinstance(x, _NP_SCALARS) and isinstance(t, torch.Tensor):    # (row_targets gives numpy views)
            t[row] = torch.from_numpy(np.asarray(x))
        else:
            t[row] = x


def rows_as_samples(layout: Layout, targets: list[torch.Tensor], rows) -> list:
    """Samples rebuilt (cloned) from written rows, for a switch to the copy
    path: each leaf of the type it had (a Python number, a numpy array, a
    tensor), so ``default_collate`` treats them as the samples still to
    come (it cannot stack a 0-dim tensor with an int)."""
    out = []
    for r in rows:
        vals = []
        for leaf, t in zip(layout.leaves, targets):
            if leaf.kind == "obj":
                vals.append(t[r])
                continue
            x = t[r].clone()
            if leaf.kind == "npscalar":
                x = x.numpy()[()]
            elif leaf.kind in _NUMBERS:
                x = x.item()
            elif leaf.kind == "numpy":
                x = x.numpy()
            vals.append(x)
        out.append(_unflatten(layout.template, iter(vals), as_sample=True))
    return out


def build(template, leaves: list[torch.Tensor]) -> Any:
    """The collated batch: ``default_collate``'s structure over ``leaves``."""
    it = iter(leaves)
    return _unflatten(template, it)


def _unflatten(tpl, it, as_sample: bool = False):
    if tpl == "*":
        return next(it)
    kind = tpl[0]
    if kind == "namedtuple":
        return tpl[1](*(_in_sequence(t, it, as_sample) for t in tpl[2]))
    if (kind == "tuple" and as_sample) or kind == "pair":     # (a pair's batch is a tuple too)
        return tuple(_unflatten(t, it, as_sample) for t in tpl[1])
    if kind in ("tuple", "list"):  # default_collate turns tuples into lists
        return [_in_sequence(t, it, as_sample) for t in tpl[1]]
    if kind == "dict":
        return {k: _unflatten(t, it, as_sample) for k, t in zip(tpl[1], tpl[2])}
    raise AssertionError(tpl)


def _in_sequence(tpl, it, as_sample: bool):
    """``_unflatten`` of an item of a sequence: a str/bytes leaf's values
    (a list) there are a tuple, as ``default_collate`` transposes a
    sequence's samples with ``zip`` (in a dict they stay the list it makes)."""
    x = _unflatten(tpl, it, as_sample)
    return tuple(x) if tpl == "*" and type(x) is list and not as_sample else x


def _leaf_paths(tpl, path: tuple, out: list) -> list:
    """The paths (keys and indices into the collated batch) of ``tpl``'s
    leaves, in leaf order."""
    if tpl == "*":
        out.append(path)
    elif tpl[0] == "dict":
        for k, t in zip(tpl[1], tpl[2]):
            _leaf_paths(t, path + (k,), out)
    else:
        for i, t in enumerate(tpl[2] if tpl[0] == "namedtuple" else tpl[1]):
            _leaf_paths(t, path + (i,), out)
    return out


def _get(batch, path: tuple):
    for key in path:
        batch = batch[key]
    return batch


def samples_of(device_batch, host_batch, layout: "Layout | None", on_device) -> list:
    """The samples of a default-collated batch, for a ``collate_fn`` that
    runs after the device stage (``decode="device"``): the leaves at the
    paths ``on_device`` are the rows of ``device_batch``'s (the images, on
    the device); every other leaf is a copy of ``host_batch``'s row, of the
    kind the dataset returned (a Python number, a numpy array, a CPU
    tensor).  With ``layout`` (the batch was collated in place) each sample
    has the structure the dataset returned, tuples included; without one
    (the copy path), default collation's (a tuple is a list, a number a
    0-dim tensor), with each list of plain values (strings) split by row."""
    on_device = set(on_device)
    if layout is not None:
        columns = []
        for path, leaf in zip(_leaf_paths(layout.template, (), []), layout.leaves):
            if path in on_device:
                columns.append(list(_get(device_batch, path).unbind(0)))
                continue
            x = _get(host_batch, path)
            if leaf.kind == "obj":
                columns.append(list(x))
            elif leaf.kind == "npscalar":
                columns.append(list(x.numpy().copy()))
            elif leaf.kind in _NUMBERS:
                columns.append(x.tolist())
            elif leaf.kind == "numpy":
                columns.append(list(x.numpy().copy()))
            else:
                columns.append(list(x.clone().unbind(0)))
        n = len(columns[0]) if columns else 0
        return [_unflatten(layout.template, iter([c[r] for c in columns]), as_sample=True) for r in range(n)]
    rows = _split_rows(device_batch, host_batch, (), on_device)
    return rows if rows is not None else []


def _split_rows(dev, host, path: tuple, on_device: set):
    """Per row, the part of a default-collated batch at ``path`` (see
    :func:`samples_of`); None for a part that is not split by row."""
    if isinstance(host, torch.Tensor):
        x = dev if path in on_device else host.clone()
        return list(x.unbind(0)) if x.dim() > 0 else None
    if isinstance(host, (str, bytes)) or not isinstance(host, (list, tuple, dict)):
        return None
    if isinstance(host, dict):
        parts = {k: _split_rows(dev[k], v, path + (k,), on_device) for k, v in host.items()}
        n = _rows_in(parts.values())
        return [{k: (p[r] if p is not None else host[k]) for k, p in parts.items()} for r in range(n)]
    if isinstance(host, list) and host and all(isinstance(v, (str, bytes, int, float)) for v in host):
        return list(host)     # default collation's list of plain values (strings)
    parts = [_split_rows(d, v, path + (i,), on_device) for i, (d, v) in enumerate(zip(dev, host))]
    n = _rows_in(parts)
    rows = [[p[r] if p is not None else v for p, v in zip(parts, host)] for r in range(n)]
    if isinstance(host, tuple) and hasattr(host, "_fields"):
        return [type(host)(*row) for row in rows]
    return rows


def _rows_in(parts) -> int:
    ns = {len(p) for p in parts if p is not None}
    if len(ns) > 1:
        raise ValueError(f"the batch's parts have different numbers of rows ({sorted(ns)}): it cannot be split "
                         "into samples for the collate_fn")
    return ns.pop() if ns else 0


def is_default_collate(fn) -> bool:
    from torch.utils.data._utils.collate import default_collate as dc

    return fn is None or fn is dc or fn is torch.utils.data.default_collate


def is_fast_collate(fn) -> bool:
    """Whether ``fn`` is timm's ``fast_collate`` (what its ``create_loader``
    gives the loader with its prefetcher, timm's default): the function
    of the imported ``timm.data.loader`` itself (looked up there, never
    imported here).  Its batch of (uint8 image, class index) samples is
    collated in place (``layout_of(..., pair=True)``); of any other
    samples it runs as written."""
    mod = sys.modules.get("timm.data.loader")
    return fn is not None and mod is not None and fn is getattr(mod, "fast_collate", None)


def _bytes_of(x) -> np.ndarray:
    return np.frombuffer(x.numpy() if isinstance(x, torch.Tensor) else x, dtype=np.uint8)


def pack_payloads(b, rows: list, slots) -> None:
    """decode="device": the payloads of ``rows`` of batch ``b`` (an engine's
    builder: JPEG bytes, or uint8 images the CPU path made), one after the
    other in a buffer from ``slots`` (a shared-memory slot in a worker), in
    the batch's row order and, within a row, its records' order: ``BatchStats.device_blob`` =
    (slot, total bytes, int64 [(offset, length), ...]).  The main process
    decodes from there (coordl.device.decode)."""
    items = [p for r in rows for p in b.payloads[r]]
    # a payload is the bytes or image, or (that, the float32 noise of its erasing) packed one after the other
    parts = [[_bytes_of(x) for x in (p if type(p) is tuple else (p,))] for p in items]
    total = sum(v.size for ps in parts for v in ps)
    slot, buf = slots.acquire(max(total, 1))
    offsets = np.empty((len(parts), 2), dtype=np.int64)
    o = 0
    for k, ps in enumerate(parts):
        start = o
        for v in ps:
            buf[o:o + v.size] = v
            o += v.size
        offsets[k] = (start, o - start)
    b.stats.decoded_cpu += sum(isinstance(p[0] if type(p) is tuple else p, torch.Tensor) for p in items)
    b.stats.device_blob = (slot, total, offsets)
    b.payloads = None


# ------------------------------------------------- a collate_fn's batch, packed
class Packed:
    """A ``collate_fn``'s batch with its tensors copied into a slot
    (:func:`pack`): ``spec`` is its structure, each packed tensor a
    ``("t", k, dtype, shape)`` there (the ``k``-th, at ``offsets[k]`` of the
    slot) and anything else kept as it is (pickled with the message, as
    torch sends it); ``nbytes`` the slot's bytes in use.  :func:`unpack`
    rebuilds the batch over the slot."""

    __slots__ = ("spec", "offsets", "nbytes")

    def __init__(self, spec, offsets: list, nbytes: int) -> None:
        self.spec = spec
        self.offsets = offsets
        self.nbytes = nbytes

    def __getstate__(self):
        return self.spec, self.offsets, self.nbytes

    def __setstate__(self, state) -> None:
        self.spec, self.offsets, self.nbytes = state


#: leaves other than tensors that a packed batch may hold (pickled by value, as torch's path sends them)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.ndarray, np.generic, torch.dtype, torch.device)


class _NotPacked(Exception):
    pass


def pack(batch, slots) -> "tuple | None":
    """``(slot, Packed)``: ``batch`` (what a ``collate_fn`` returned in a
    worker) with each of its tensors copied into one buffer from ``slots``
    (a worker's shared-memory slot, mapped by the main process already),
    so that the batch crosses to the main process with one copy into
    memory that is already there, where torch's pickling makes a new
    shared-memory segment per tensor (its pages faulted in on both sides).
    None, and torch's way, for a batch this cannot rebuild exactly: one
    that holds any object other than lists, tuples, namedtuples, dicts and
    plain values (:data:`_PLAIN`), or a tensor that is not a plain
    contiguous CPU tensor without autograd (a subclass, another memory
    format, a view whose strides matter...), or two tensors over one
    storage (torch keeps them aliased), or no tensor to pack."""
    tensors: list = []
    try:
        spec = _spec(batch, tensors)
    except _NotPacked:
        return None
    if not tensors:
        return None
    ptrs = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
    if len(set(ptrs)) != len(ptrs):     # views of one storage: torch's way keeps them aliased
        return None
    try:    # each tensor's bytes (a dtype torch cannot view as bytes: torch's way)
        raw = [t.reshape(-1).view(torch.uint8).numpy() if t.numel() else None for t in tensors]
    except (RuntimeError, TypeError):
        return None
    offsets, off = [], 0
    for r in raw:
        off = (off + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(off)
        off += 0 if r is None else r.size
    slot, buf = slots.acquire(max(off, 1))
    for r, o in zip(raw, offsets):
        if r is not None:
            buf[o:o + r.size] = r
    return slot, Packed(spec, offsets, off)


def _spec(x, tensors: list):
    if type(x) is torch.Tensor:
        if x.is_shared():       # already in shared memory (default_collate's stack in a worker): its fd, as torch
            return ("o", x)
        if (x.device.type != "cpu" or x.layout != torch.strided or x.requires_grad or x.is_quantized
                or x.is_conj() or x.is_neg() or not x.is_contiguous()):
            raise _NotPacked
        tensors.append(x)
        return ("t", len(tensors) - 1, x.dtype, tuple(x.shape))
    if isinstance(x, _PLAIN):
        return ("o", x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return ("n", type(x), [_spec(v, tensors) for v in x])
    if type(x) is tuple:
        return ("u", [_spec(v, tensors) for v in x])
    if type(x) is list:
        return ("l", [_spec(v, tensors) for v in x])
    if type(x) is dict:
        return ("d", [(k, _spec(v, tensors)) for k, v in x.items()])
    raise _NotPacked


def unpack(packed: Packed, buf: np.ndarray):
    """The batch of :func:`pack`, its tensors over ``buf`` (the slot)."""
    return _unpack(packed.spec, packed.offsets, buf)


def _unpack(spec, offsets, buf):
    kind = spec[0]
    if kind == "t":
        _, k, dtype, shape = spec
        n = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
        if not n:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(buf[offsets[k]:offsets[k] + n]).view(dtype).view(shape)
    if kind == "o":
        return spec[1]
    if kind == "n":
        return spec[1](*(_unpack(s, offsets, buf) for s in spec[2]))
    if kind == "u":
        return tuple(_unpack(s, offsets, buf) for s in spec[1])
    if kind == "l":
        return [_unpack(s, offsets, buf) for s in spec[1]]
    return {k: _unpack(s, offsets, buf) for k, s in spec[1]}
