"""``coordl.DataLoader``: torch's DataLoader, plus the epoch plan, two-stage
fetch/prep, resumable state and statistics.

How a loader decides what to do (see docs/architecture.md for the diagram):

* **Order.**  With no ``sampler``/``batch_sampler`` and either a two-stage
  dataset or an explicit ``seed``, the order is coordl's epoch plan, a pure
  function of (seed, epoch, rank, world_size).  Otherwise torch's own samplers
  run, untouched, so a script that worked under torch sees the same batches;
  over a two-stage dataset a sampler with a length is read once per pass and
  its order runs on coordl's pipeline (``pipeline.modes.sampler_order``).
* **Work per batch.**  A two-stage dataset runs ``raw`` then ``prep`` under a
  per-sample generator (``TwoStageFetch``); an unmodified ``TensorDataset``
  with default collation takes one gather per tensor instead of N
  ``__getitem__`` calls plus a stack (identical output); anything else runs
  exactly as torch runs it.
* **Placement.**  torch's worker machinery (worker processes, their crash
  detection, ``timeout``, ``worker_init_fn``, pinning) runs the work;
  coordl swaps in its dataset wrapper and index sampler only while torch
  builds the iterator, so the user's objects are never modified.
"""
from __future__ import annotations

import contextlib
import inspect
import types
import warnings
import weakref
from typing import TypeVar

import torch
import torch.distributed as dist
# torch's class from its own module: a script may point torch.utils.data.DataLoader at coordl's
from torch.utils.data.dataloader import DataLoader as _TorchDataLoader
from torch.utils.data.dataloader import _DatasetKind

from .base import reaper as _reaper
from .base.forks import starting_workers
from .base.units import parse_size
from .errors import StateError
from .pipeline.modes import PipelineMode, choose_mode
from .pipeline.passes import _first_tensor, _LoaderIter, _Pass, _PassSampler
from .plan import EpochPlan, check_seed
from .protocol import is_two_stage
from .stats import Counters, LoaderStats

__all__ = ["DataLoader"]

_T_co = TypeVar("_T_co", covariant=True)

_STATE_FORMAT = "coordl.DataLoader"
_STATE_VERSION = 3  # 2 added "done", 3 "dataset"; states of versions 1 and 2 still load
#: the most a loader attaching the node cache waits for the clean-ups queued before it (a dropped loader's
#: hold, its workers' stop); past it, it attaches as things are
_REAPER_WAIT = 10.0
_NOT_SPLIT_SHARED = "not split (share=True: the node daemon prepares samples whole): images are converted on the CPU"


# the keyword arguments DataLoader adds to torch's
_OWN_ARGUMENTS = ("seed", "cache_size", "device", "decode", "on_error", "rank", "world_size", "read_ahead",
                  "fetch_threads", "cache_checksum", "cache_keep_warm", "share", "peers", "progress", "jpeg_draft")


def _snapshot(samples) -> tuple:
    """A folder's ``samples`` list and a shallow copy of its items, to see
    at the next pass whether either changed (:func:`_same_items`)."""
    return samples, (list(samples) if samples is not None else None)


def _same_items(now, items) -> bool:
    """Whether the list ``now`` holds the same items as the copy ``items``."""
    try:
        return bool((now if isinstance(now, list) else list(now)) == items)
    except Exception:  # noqa: BLE001 - items whose comparison fails: looked at as changed (follow_samples decides)
        return False


class DataLoader(_TorchDataLoader[_T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` that stops training waiting for data.

    Every positional and keyword parameter of torch's DataLoader is accepted
    with the same default and validated by torch itself (same messages).  For
    a dataset that is not two-stage and without ``seed=``, batches, order,
    errors and worker semantics are torch's.  A two-stage dataset (``raw`` and
    ``prep``, see :class:`coordl.TwoStageDataset`) runs on coordl's pipeline:
    the epoch plan, read-ahead, the node cache, zero-copy batches, exact
    resume.  ``stats().path_reason`` says which machinery runs the passes and
    why.  The user guide (:doc:`/guide/quickstart`) explains each feature.

    Keyword-only extras:

    seed
        Seed of the epoch plan and of per-sample augmentation generators.  For
        a two-stage dataset, ``None`` draws one from ``generator`` (or torch's
        global RNG, so ``torch.manual_seed`` controls it); under
        ``torch.distributed``, when the plan spans the ranks, every rank takes
        rank 0's, passed over the process group's key-value store (rank 0
        never waits; another rank waits for rank 0's loader up to
        ``COORDL_PEER_RENDEZVOUS_TIMEOUT``, default 300 s, then raises).  With
        a ``sampler``/``batch_sampler`` it is taken from a copy of
        ``generator``, which is left where it was.  For any other map-style
        dataset, giving a seed opts into coordl's epoch plan (order a pure
        function of seed and epoch, exact resume); ``None`` keeps torch's
        samplers.
    cache_size
        Node cache of raw sample bytes (MinIO: fill, never evict) in POSIX
        shared memory, shared by every process of the user on the node that
        reads the same files: bytes (an ``int``, or a whole float like
        ``2e9``), ``"20GiB"``, ``"512MB"`` or ``"50%"`` of available memory (a
        size that is not a whole number of bytes is refused; with a unit a
        fraction rounds down).  ``0``/``None`` (the default) disables it.  The
        whole budget is reserved in ``/dev/shm/coordl-<uid>/``
        (``$COORDL_SHM_DIR``) when the loader is created, charged to this
        job's memory cgroup: a ``/dev/shm`` too small for it raises
        ``MemoryError`` here, naming the remedy.  Needs a two-stage dataset
        with ``fingerprint()`` on coordl's pipeline; elsewhere it warns that
        it has no effect.  See :doc:`/guide/cache`.
    cache_checksum
        Verify every hit's CRC32 and raise on a mismatch (corruption).
        Entries always carry a CRC32 and are always checked for length; on
        CPUs other than x86 every hit is checked anyway (a mismatch there is
        a miss).
    cache_keep_warm
        Seconds the cache outlives its last user, so that a back-to-back job
        starts warm; the longest value any user of the cache asked for
        applies.  Removed after that by the next coordl start on the node,
        or at once by ``coordl cache clear``.
    device
        Deliver batches on this device (``"cuda"``, ``"cuda:1"``, a
        ``torch.device``).  With CUDA, batches are staged into pinned
        buffers and copied with ``non_blocking=True`` on a side stream, and a
        coordl ``Compose`` ending in ``ToTensor`` and ``Normalize`` is split
        so that uint8 images travel and the scaling runs on the device (bit
        for bit the CPU path's values).  ``"cpu"``/``None``: batches stay
        where they are.  A CUDA device on a machine without CUDA is refused
        here.  See :doc:`/guide/gpu`.
    decode
        ``"cpu"`` (default): images are decoded and transformed in the
        workers.  ``"device"`` (with a CUDA ``device``): the workers read
        each JPEG's bytes, its header and its crop and flip (drawn from
        (seed, epoch, index) as on the CPU) and the main process decodes
        the batch on the device in one call, then crops, resizes, flips
        and normalizes there; for when the CPU cannot keep up with the
        GPU.  Refused with ``share=True``, a ``collate_fn``,
        ``batch_size=None`` and datasets torch's machinery reads.  With
        ``device="cpu"``, the same path on the CPU, a CPU decoder standing
        in for the GPU's (to test a GPU script's loader where there is no
        GPU; ``decode="cpu"`` is the fast way on a CPU).  Supported
        transforms, the tolerance against the CPU path and the fallbacks:
        :doc:`/guide/gpu`.
    on_error
        ``"raise"`` (default): a bad sample raises ``SampleError`` naming its
        index and path, which is also an instance of the sample's own error
        type (``except OSError`` works, as under torch), for its batch; as
        under torch, the next ``next()`` goes on with the following batch,
        and the failed batch counts as used up in ``state_dict()``.
        ``"skip"``: drop the sample, emit one ``SkippedSampleWarning`` per
        sample in the main process and count it in ``stats().skipped``; a
        batch whose samples are all bad is dropped.  Works for any map-style
        dataset; refused for an ``IterableDataset``.
    rank, world_size
        The epoch plan's partition; default from ``torch.distributed`` when it
        is initialized, else 0 and 1.
    read_ahead
        Byte budget of the fetch stage's read-ahead, all workers together
        (a size as for ``cache_size``; default ``"64MiB"``).
    fetch_threads
        The most fetch threads per worker; default 8 for local files, 16
        for URLs read through fsspec (each reads batches of up to 8
        objects), 64 for URLs read through obstore (one object each).  A
        worker starts one and adds one each time its prep waits on a read,
        up to this (a persistent worker starts its next epoch with half
        the count).  Reads per second ~ reads in flight / storage latency; for
        URLs, the requests in flight to one host adapt to what the server
        sustains (:doc:`/guide/storage`).
    share
        Prepare samples once for every job on the node that reads the same
        dataset with the same transforms, seed, shuffle and partition,
        through the node daemon (``coordl daemon``; started detached if none
        runs).  Batches are bit-identical to ``share=False``.  ``None``
        (default): ``True`` when the environment has ``COORDL_SHARE=1``.
        Needs the epoch plan (no sampler).  See :doc:`/guide/sharing`.
    peers
        Partitioned caching across nodes under torch.distributed: a sample
        missing from this node's cache is read from the node whose cache
        holds it, before storage.  ``"auto"`` (default; ``None`` reads
        ``COORDL_PEERS``, else "auto"): on when the process group spans
        more than one node and the node cache is on; ``"on"``: the same, and
        an error when it cannot be; ``"off"``.  Building the loader is
        collective only when every rank can tell alone that peers may be on
        (a node cache, a process group, no launcher saying one node); then
        every rank must build it, and a rank that does not, or builds
        another loader, is an error on every rank.  See
        :doc:`/guide/multinode`.
    progress
        A tqdm progress bar per pass, kept on screen when the pass ends, with
        batches/s, samples/s (over the same time, so samples/s = batches/s x
        samples per batch) and the data stall of the pass (the share of the
        time the training loop waited in ``next()``).  Needs tqdm (``pip
        install tqdm`` or ``coordl[progress]``); without it, one warning and
        no bar.
    jpeg_draft
        torchvision ``ImageFolder``/``DatasetFolder`` only: let the fused
        decode start at a reduced JPEG DCT scale (1/2, 1/4, 1/8) when the
        pipeline's first step is an antialiased bilinear or bicubic
        ``Resize``/``RandomResizedCrop`` and the image (or crop) is at least
        twice the output size: faster on large images, pixels no longer
        torchvision's (:doc:`/guide/torchvision`).  ``stats().path_reason``
        says when it is in play, or that it has no effect (nearest,
        ``antialias=False``).  Off by default; on another dataset it warns
        and does nothing.  coordl's own transforms take ``draft=True``.

    A ``sampler`` or ``batch_sampler`` with a length over a two-stage
    dataset runs on coordl's pipeline in the sampler's order, iterated once
    per pass in the main process when the pass starts, after the same draw
    of the iterator's base seed as torch's: the same indices and batches as
    torch's DataLoader for the same torch seed.  A sampler without a length
    stays on torch's machinery (:doc:`/guide/datasets`).

    ``iter(loader)`` returns an object with the attributes of torch's
    iterator that tests and libraries read, on every placement:
    ``_workers`` (the worker processes; empty with ``num_workers=0``),
    ``_num_yielded``, ``_shutdown_workers()`` (stops the workers; the pass
    then ends and the next ``iter(loader)`` starts new ones), ``_dataset``,
    ``_collate_fn`` (the user's, never coordl's wrappers),
    ``_index_sampler``, ``_num_workers``, ``_prefetch_factor``,
    ``_persistent_workers``, ``_in_order``, ``_timeout``, ``_pin_memory``,
    ``_drop_last``, ``_auto_collation``, ``_dataset_kind``, ``_base_seed``,
    ``_world_size``, ``_rank``.  ``coordl.DataLoader[T]`` subscripts like
    torch's.  Requires torch 2.6 or newer (``in_order``,
    ``torch.accelerator``).
    """

    def __init__(
        self,
        dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler=None,
        batch_sampler=None,
        num_workers: int = 0,
        collate_fn=None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        cache_size: int | str | None = None,
        device: str | torch.device | None = None,
        decode: str = "cpu",
        on_error: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
        read_ahead: int | str = "64MiB",
        fetch_threads: int | None = None,
        cache_checksum: bool = False,
        cache_keep_warm: float = 0,
        share: bool | None = None,
        peers: str | None = None,
        progress: bool = False,
        jpeg_draft: bool = False,
    ) -> None:
        from .tvcompat import adapt, record_path

        # every argument as given (the user's own dataset among them): what pickling builds again from
        self._built_with = {name: value for name, value in locals().items() if name in _INIT_PARAMETERS}
        if not isinstance(jpeg_draft, bool):
            raise TypeError(f"jpeg_draft should be a bool, but got jpeg_draft={jpeg_draft!r}")
        # torchvision's ImageFolder/DatasetFolder -> coordl's two-stage dataset (see coordl/tvcompat.py)
        source = dataset
        dataset, tv_decision = adapt(dataset, jpeg_draft=jpeg_draft)
        # the user's dataset, which of its datasets coordl translated (itself, or those inside its Subsets and
        # ConcatDatasets: _leaves), and their transforms then: one assigned to them later, or changed in place, is
        # translated at the next pass (_follow_torchvision), as torch would run it
        self._tv_source = None
        followed: list = []
        users, mine = _leaves(source), _leaves(dataset)
        if tv_decision is not None and tv_decision.path == "coordl":
            followed = [k for k, (u, m) in enumerate(zip(users, mine)) if u is not m]
            self._tv_source = (source, followed, [_transforms_seen(users[k]) for k in followed], jpeg_draft)
        # the translated transforms coordl set on its copies (by leaf): another one there was assigned by the user
        self._tv_set = {k: mine[k].transform for k in followed}
        self._tv_assigned: dict = {}  # leaf -> (the user's transform assigned to coordl's copy, its spec), translated
        self._wraps = dataset is not source   # coordl reads a copy of the user's dataset (_check_source)
        # the user's folders' lists of samples (by leaf), as coordl read them, each with a shallow copy of its
        # items (10 MB for 1.28M samples): one assigned anew, or changed in place, is looked at (_check_source)
        self._samples_seen = {k: _snapshot(getattr(users[k], "samples", None)) for k in followed}
        # by keyword: a tool that records the arguments of torch's __init__ to build the loader again with
        # one of them replaced (PyTorch Lightning's sampler injection, when it did not see this class's own
        # __init__) then replaces it, where positional ones would be given twice
        super().__init__(
            dataset=dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last,
            timeout=timeout, worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
        seed = self._check_options(
            dataset, seed=seed, on_error=on_error, cache_size=cache_size, cache_checksum=cache_checksum,
            cache_keep_warm=cache_keep_warm, progress=progress, device=device, read_ahead=read_ahead,
            fetch_threads=fetch_threads, decode=decode)
        iterable = self._dataset_kind == _DatasetKind.Iterable
        user_sampler = sampler is not None or batch_sampler is not None
        two_stage = not iterable and is_two_stage(dataset)
        plan_order = self._choose_order(
            dataset, seed=seed, iterable=iterable, user_sampler=user_sampler, two_stage=two_stage,
            on_error=on_error, rank=rank, world_size=world_size, generator=generator,
            plan=(batch_size, shuffle, drop_last))
        self._choose_mode(dataset, two_stage=two_stage, plan_order=plan_order, user_sampler=user_sampler,
                          iterable=iterable, on_error=on_error, user_collate=collate_fn is not None,
                          batch_size=batch_size, share=share,
                          sized_sampler=user_sampler and two_stage and _has_len(self._index_sampler))
        self._check_decode(dataset, share=share, two_stage=two_stage, user_sampler=user_sampler)
        self._open_node_cache(dataset, cache_size, user_sampler)
        self._open_peers(peers)
        self._pass = _Pass()
        self._pass_sampler = _PassSampler(self)
        # the index sampler as made: one replaced by an endless repeat of it is recognized (_sampler_now)
        self.__dict__["_made_index_sampler"] = _TorchDataLoader._index_sampler.fget(self)
        self._counters = Counters()
        record_path(self, tv_decision)
        # coordl's own arguments, as given, under their names in the instance's dictionary (where one is a
        # property, the property still answers reads): tools that build a loader again from its attributes,
        # with a sampler of their own, find them there as they find torch's (PyTorch Lightning, putting a
        # DistributedSampler into a loader passed to Trainer.fit)
        self.__dict__.update({name: self._built_with[name] for name in _OWN_ARGUMENTS})

    def __reduce__(self):
        """A loader pickles (and copies) as what builds it again: the
        arguments it was built with, the seed, rank and world size it took
        (so that the copy delivers the same batches without asking anyone
        for them), and its :meth:`state_dict`, so that the copy goes on
        where this loader is (mid-epoch: the batches not yet delivered).
        Its workers, node cache and connections are not copied: the copy
        opens its own.  As under torch, what it was given must pickle."""
        args = dict(self._built_with, seed=self._seed, rank=self._rank, world_size=self._world_size)
        return _built_again, (type(self), args, self.state_dict())

    # ------------------------------------------------- the steps of __init__
    # Warnings raised here name the user's call: stacklevel 3 (step, __init__, caller).

    def _check_options(self, dataset, *, seed, on_error, cache_size, cache_checksum, cache_keep_warm,
                       progress, device, read_ahead, fetch_threads, decode) -> int | None:
        """Validate coordl's own keyword arguments and keep them; returns the checked seed."""
        if decode not in ("cpu", "device"):
            raise ValueError(f'decode should be "cpu" or "device", but got decode={decode!r}')
        self._decode = decode
        self._decoder = self._decode_stage = None
        self._collate_later = False     # decode="device" with a collate_fn: it runs on the device's batch
        self._cpu_share = 0.0
        self._check_data = False
        if on_error not in ("raise", "skip"):
            raise ValueError(f'on_error should be "raise" or "skip", but got on_error={on_error!r}')
        if seed is not None:
            seed = check_seed(seed)
        self._cache_size = parse_size(cache_size, "cache_size")
        if not isinstance(cache_checksum, bool):
            raise ValueError(f"cache_checksum should be a bool, but got cache_checksum={cache_checksum!r}")
        if isinstance(cache_keep_warm, bool) or not isinstance(cache_keep_warm, (int, float)) or cache_keep_warm < 0:
            raise ValueError(f"cache_keep_warm should be a number of seconds >= 0, but got "
                             f"cache_keep_warm={cache_keep_warm!r}")
        self._cache_opts = (cache_checksum, float(cache_keep_warm))
        if not isinstance(progress, bool):
            raise ValueError(f"progress should be a bool, but got progress={progress!r}")
        if progress:
            try:
                import tqdm  # noqa: F401
            except ImportError:
                warnings.warn("progress=True needs tqdm (pip install tqdm, or coordl[progress]); "
                              "no progress bar is shown", stacklevel=3)
                progress = False
        self._progress = progress
        self._device = _parse_device(device, decode)
        if decode == "device" and self._device is None:
            raise ValueError(
                "decode='device' should come with device= the CUDA device the images are decoded and delivered "
                f"on (device=\"cuda\"; device=\"cpu\" runs the CPU stand-in for the GPU's decoder), but got "
                f"device={device!r}")
        if self._device is not None:
            from .device import waits

            waits.wanted()      # a wrong COORDL_CUDA_WAIT fails here, naming its values
        self._delivery = None
        self._device_tail = None
        self._on_error = on_error
        self._read_ahead = parse_size(read_ahead, "read_ahead")
        if self._read_ahead < 1:
            raise ValueError(f"read_ahead should be a positive size like \"64MiB\", but got read_ahead={read_ahead!r}")
        if fetch_threads is None:  # remote storage needs more reads in flight to hide latency
            store = getattr(dataset, "_store", None)
            # fsspec: 16 threads reading batches of up to 8; obstore: one object per thread
            fetch_threads = 8 if store is None else 64 if getattr(store, "native", False) else 16
        if isinstance(fetch_threads, bool) or not isinstance(fetch_threads, int) or fetch_threads < 1:
            raise ValueError(f"fetch_threads should be None or a positive int, but got fetch_threads={fetch_threads!r}")
        self._fetch_threads = fetch_threads
        return seed

    def _choose_order(self, dataset, *, seed, iterable, user_sampler, two_stage, on_error, rank, world_size,
                      generator, plan) -> bool:
        """The epoch plan (coordl's order) or torch's samplers; the rank, world size and seed
        (agreed across ranks when none is given).  Returns whether the plan gives the order."""
        batch_size, shuffle, drop_last = plan
        if iterable and on_error == "skip":
            raise ValueError(
                'on_error should be "raise" for an IterableDataset (its errors come from its own '
                'iterator, which coordl cannot resume past), but got on_error="skip"'
            )
        plan_order = not iterable and not user_sampler and (two_stage or seed is not None)
        self._rank, self._world_size = _rank_and_world(rank, world_size)
        if (plan_order or two_stage) and seed is None:
            if user_sampler:
                # the order is the sampler's, drawn as torch draws it: the seed of per-sample
                # augmentation is taken without advancing the generator the sampler or the
                # iterator will draw from (so the same torch seed gives torch's indices)
                drawn = _peek_seed(generator)
            else:
                drawn = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
            seed = _agree_on_seed(drawn, dataset, self._rank, self._world_size,
                                  (batch_size, bool(shuffle), drop_last))
        self._seed = seed
        self._plan = None
        if plan_order:
            self._plan = EpochPlan(
                num_samples=len(dataset), seed=seed, batch_size=batch_size,
                shuffle=bool(shuffle), drop_last=drop_last,
                rank=self._rank, world_size=self._world_size,
            )
        return plan_order

    def _choose_mode(self, dataset, *, two_stage, plan_order, user_sampler, iterable, on_error, user_collate,
                     batch_size, share, sized_sampler) -> None:
        """How passes run (table in docs/architecture.md, "Modes"), the node daemon first with share=True."""
        self._mode = choose_mode(dataset, two_stage=two_stage, plan_order=plan_order,
                                 user_sampler=user_sampler, iterable=iterable, on_error=on_error,
                                 seed=self._seed, collate_fn=self.collate_fn, user_collate=user_collate,
                                 batch_size=batch_size, sized_sampler=sized_sampler)
        from .daemon.member import ShareMode, share_requested

        self._share = share_requested(share)
        if self._share and isinstance(self._mode, PipelineMode) and plan_order:
            self._mode = ShareMode()
        elif self._share and share is not None:
            warnings.warn(
                "share=True has no effect here: the node daemon prepares samples of two-stage datasets "
                "(raw/prep) read in coordl's epoch-plan order; this loader "
                f"{'has a user sampler' if user_sampler else 'reads a dataset without raw/prep'}",
                stacklevel=3)

    def _check_decode(self, dataset, *, share, two_stage: bool, user_sampler: bool) -> None:
        """decode="device": refuse at construction what the device stage
        cannot run, saying why and what to do; find the decoder."""
        if self._decode != "device":
            return
        from .device.decode import decoder_for
        from .device.decoders import check_data, cpu_share, decoder_threads
        from .device.encoded import plan_for

        if self._share:
            how = "share=True" if share else "COORDL_SHARE=1 in the environment"
            raise ValueError(
                f"decode='device' cannot run with sharing ({how}): the node daemon prepares samples whole, on "
                "its CPUs, and does not stage compressed bytes for each job to decode on its own device. Pass "
                "share=False (the node cache still shares the files' bytes between the jobs of a node), or "
                "decode='cpu' to share the prepared samples")
        if type(self._mode) is not PipelineMode:
            why = ("it has a sampler or batch_sampler of its own" if user_sampler and two_stage else
                   "it is an IterableDataset" if self._dataset_kind == _DatasetKind.Iterable else
                   f"its dataset ({type(dataset).__name__}) has no raw/prep (two stages: the file's bytes, then "
                   "decode and transform)")
            raise ValueError(
                f"decode='device' runs in coordl's pipeline (a two-stage dataset such as coordl.ImageFolder or "
                f"torchvision's ImageFolder, read in coordl's epoch plan), but this loader cannot use it: {why}. "
                "Use decode='cpu'")
        from .tvcompat import TorchvisionArrays

        base = _inner(dataset)     # (in a Subset, the dataset inside)
        if isinstance(base, torch.utils.data.ConcatDataset):
            raise ValueError(
                "decode='device' runs one transform over the images of a batch on the device, but this loader's "
                "dataset is a ConcatDataset, whose parts each run their own. Pass device= without decode='device' "
                "(the batches are copied to the device), or use decode='cpu'")
        if isinstance(base, TorchvisionArrays):
            raise ValueError(
                f"decode='device' decodes the JPEG files of a batch on the device, but {base._source}'s images "
                "are already decoded, in an array in memory: there is nothing to decode. Pass device= without "
                "decode='device' (the device split: uint8 images travel and are converted on the device)")
        if getattr(base, "views_after_transform", False):
            raise ValueError(
                f"decode='device' decodes each image of a batch on the device into one tensor, but "
                f"{base._source} runs code of its own on each image after its transform, on the CPU (several "
                "views of it, or a subclass's own __getitem__). Pass "
                "device= without decode='device' (the batches are copied to the device), or use decode='cpu'")
        if not self._auto_collation:
            raise ValueError(
                "decode='device' needs batches (a batch_size or a batch_sampler: the device stage decodes the "
                "images of a batch together), but got batch_size=None (samples one by one, not collated); pass "
                "a batch_size, or use decode='cpu'")
        plan_for(getattr(dataset, "transform", None))
        # nvImageCodec's CPU threads: as many as the loader's workers unless COORDL_DEVICE_DECODER_THREADS says
        self._decoder = decoder_for(self._device, cpu_threads=decoder_threads(self.num_workers))
        self._cpu_share = cpu_share(self.num_workers)     # COORDL_DEVICE_DECODER's "workers", read with the decoder
        self._check_data = check_data()                   # COORDL_DEVICE_CHECK_DATA
        if not self._cpu_share and cpu_share(1):
            warnings.warn('COORDL_DEVICE_DECODER names "workers", but this loader has num_workers=0: no sample '
                          "is prepared on the CPU path (the main process's time is the device stage's); give it "
                          "workers for their share", stacklevel=3)

    def _open_node_cache(self, dataset, cache_size, user_sampler: bool) -> None:
        """Attach the node cache (reserved in full now) when this loader's mode reads through it."""
        self._cache = None
        if self._cache_size and isinstance(self._mode, PipelineMode):
            if not callable(getattr(dataset, "fingerprint", None)):
                raise ValueError(
                    "cache_size should be 0 for a dataset without fingerprint() (the cache is named "
                    "after the dataset's files, so a changed dataset never reads stale bytes), but got "
                    f"cache_size={cache_size!r} for {type(dataset).__name__}; add fingerprint() -> str")
            self._cache = self._attach_cache()
        elif self._cache_size:
            warnings.warn(
                f"cache_size={cache_size!r} has no effect here: the node cache holds raw bytes of "
                "two-stage datasets (raw/prep) read in coordl's epoch-plan order; this loader "
                f"{'has a user sampler' if user_sampler else 'reads a dataset without raw/prep'}",
                stacklevel=3)

    def _open_peers(self, peers) -> None:
        """Join the nodes' peer caches when this loader's mode reads through the node cache."""
        self._peers = self._peer_server = None
        if isinstance(self._mode, PipelineMode) and self._plan is not None:
            self._setup_peers(peers)
        elif peers not in (None, "auto", "off"):
            from .peers.rendezvous import _want

            _want(peers)   # a bad value is an error everywhere
            warnings.warn(f"peers={peers!r} has no effect here: peers serve node caches of two-stage datasets "
                          "(raw/prep) read in coordl's epoch-plan order", stacklevel=3)

    # ------------------------------------------------------------------ public
    @property
    def seed(self) -> int | None:
        """The seed of the epoch plan and the per-sample generators (None with torch's samplers)."""
        return self._seed

    @property
    def cache_size(self) -> int:
        """The node cache's budget in bytes (0 when there is no node cache)."""
        return self._cache_size

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def decode(self) -> str:
        """Where this loader decodes images, ``"cpu"`` (in the workers) or ``"device"``."""
        return self._decode

    @property
    def on_error(self) -> str:
        return self._on_error

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next pass."""
        p = self._pass
        return p.epoch if p.live() else p.next_epoch

    @property
    def plan(self) -> EpochPlan | None:
        """The epoch plan, when coordl chooses the order (else None)."""
        return self._plan

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (without it, each pass advances by one).

        Forwarded to a user sampler that has ``set_epoch`` (DistributedSampler).
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative int, but got epoch={epoch!r}")
        p = self._pass
        p.next_epoch = epoch
        if p.resume is not None and p.resume["epoch"] != epoch:
            r = p.resume
            if r["batches"] or r["done"]:
                try:
                    of = f" of {len(self)}"
                except TypeError:   # an iterable dataset or a sampler without a length
                    of = ""
                warnings.warn(
                    f"set_epoch({epoch}) drops the position load_state_dict restored (epoch {r['epoch']}, "
                    f"{r['batches'] + len(r['done'])}{of} batches delivered): the next pass is all of epoch "
                    f"{epoch}. To finish the interrupted epoch, start the loop at the loaded epoch "
                    f"(loader.epoch, {r['epoch']}) and call set_epoch with it (see docs/guide/resume.md, "
                    "\"The resume loop\")", stacklevel=2)
            p.resume = None
        for s in (self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            fn = getattr(s, "set_epoch", None)
            if callable(fn):
                fn(epoch)
                break

    def stats(self) -> LoaderStats:
        """A frozen record of what the loader did so far (see ``LoaderStats``)."""
        return self._counters.snapshot()

    def state_dict(self) -> dict:
        """What the loader will do next: (epoch, steps already delivered) plus
        what must match on restore.

        ``batches`` steps of ``epoch`` were delivered in plan order, and the
        steps listed in ``done`` beyond them (out-of-order delivery); a step
        whose samples were all skipped counts as delivered.  A pass is in
        progress while its iterator exists: once it is gone (``break``), the
        state is the start of the next epoch, as the live loader will do.
        Batches prefetched by workers but not yet delivered are not counted: a
        restored loader prepares them again.  The dict holds only plain values
        and tensors (``torch.save`` it with the model checkpoint).

        Raises ``StateError`` mid-pass when torch's worker machinery delivers
        out of order (``in_order=False`` and ``num_workers > 0`` on a loader
        that does not run coordl's own pipeline): which steps were delivered
        is not known there, so no state could resume exactly.
        """
        p = self._pass
        order = None
        if p.live():
            epoch, batches, done, rng, order = p.epoch, p.yielded, sorted(p.done), p.rng, p.order
            total = self._plan.num_batches if self._plan is not None else \
                order.num_batches if order is not None else None
            complete = total is not None and batches >= total
            if not p.exact and not complete and (batches > p.start or p.done != p.skip):
                raise StateError(
                    f"state_dict() was called in the middle of epoch {epoch} of a loader with "
                    f"in_order=False and num_workers={self.num_workers} running on torch's worker "
                    "machinery: torch hands batches over out of order without saying which step each "
                    "was, so no state could resume without repeating or dropping samples. Save the "
                    "state at an epoch boundary, or use in_order=True (or a two-stage dataset in "
                    "coordl's epoch plan, whose pipeline records the steps delivered)"
                )
        elif p.resume is not None:
            epoch, batches, rng = p.resume["epoch"], p.resume["batches"], p.resume["rng"]
            done, order = list(p.resume["done"]), p.resume.get("order")
        else:
            epoch, batches, done, rng = p.next_epoch, 0, [], None
        total = self._plan.num_batches if self._plan is not None else \
            order.num_batches if order is not None else None
        if total is not None and batches >= total:
            epoch, batches, done, rng, order = epoch + 1, 0, [], None, None
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "mode": "plan" if self._plan is not None else "torch",
            "epoch": epoch,
            "batches": batches,
            "done": done,
            "seed": self._seed,
            "num_samples": self._dataset_len(),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "shuffle": self._plan.shuffle if self._plan is not None else None,
            "rank": self._rank,
            "world_size": self._world_size,
            "rng": [s.clone() for s in rng] if rng is not None else None,
            "dataset": self._dataset_identity(),
            "order": order.to_state() if order is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next pass yields exactly the batches of
        that epoch not yet delivered, then epochs continue from there.

        Raises ``StateError`` when the state cannot be honoured without
        repeating or dropping samples (other dataset length, batch size,
        drop_last, shuffle, or world size mid-epoch).
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise StateError(
                "state should be a dict returned by coordl.DataLoader.state_dict(), "
                f"but got state={type(state).__name__} without format={_STATE_FORMAT!r}"
            )
        if state.get("version") not in (1, _STATE_VERSION):
            raise StateError(f"state version {state.get('version')!r} is not supported "
                             f"(this coordl reads versions 1 to {_STATE_VERSION})")
        mode = "plan" if self._plan is not None else "torch"
        if state["mode"] != mode:
            raise StateError(
                f"state was saved by a loader using {'its' if state['mode'] == 'plan' else 'torch'} "
                f"{'epoch plan' if state['mode'] == 'plan' else 'samplers'}, but this loader uses "
                f"{'the epoch plan' if mode == 'plan' else 'torch samplers'}: construct it the same way "
                "(same sampler/batch_sampler, seed given or not)"
            )
        epoch, batches = int(state["epoch"]), int(state["batches"])
        done = sorted(int(k) for k in state.get("done") or ())
        if done and (done[0] <= batches or len(set(done)) != len(done)):
            raise StateError(
                f"state's done should list distinct steps after batches={batches}, but got done={done!r}: "
                "pass a dict returned by state_dict() unchanged")
        if done and mode == "plan" and done[-1] >= self._plan.num_batches:
            raise StateError(
                f"state's done lists step {done[-1]}, but an epoch of this loader has "
                f"{self._plan.num_batches} batches: resume with the same dataset and batch_size")
        n = self._dataset_len()
        if state["num_samples"] is not None and n is not None and state["num_samples"] != n:
            raise StateError(
                f"state was saved for a dataset of {state['num_samples']} samples, but this loader's "
                f"dataset has {n}: resume with the same dataset"
            )
        if batches > 0 or done:
            theirs, mine = state.get("dataset"), self._dataset_identity()
            if theirs is not None and mine is not None and theirs != mine:
                raise StateError(
                    f"state was saved mid-epoch (epoch {epoch}, batch {batches}) by a loader over another "
                    f"dataset ({theirs}), but this loader's dataset is {mine}: resuming would deliver the "
                    "rest of that epoch from the wrong samples. Resume with the same dataset (the same files "
                    "under their root, which may have moved), or from an epoch boundary")
            for key, mine in (("batch_size", self.batch_size), ("drop_last", self.drop_last)):
                if state[key] != mine:
                    raise StateError(
                        f"state was saved mid-epoch with {key}={state[key]!r}, but this loader has "
                        f"{key}={mine!r}: batch {batches} would mean different samples; use the same {key}"
                    )
            if mode == "plan" and state["shuffle"] != self._plan.shuffle:
                raise StateError(
                    f"state was saved mid-epoch with shuffle={state['shuffle']!r}, but this loader has "
                    f"shuffle={self._plan.shuffle!r}"
                )
            if (state["world_size"], state["rank"]) != (self._world_size, self._rank):
                raise StateError(
                    f"state was saved mid-epoch (epoch {epoch}, batch {batches}) by rank "
                    f"{state['rank']} of world_size={state['world_size']}, but this loader is rank "
                    f"{self._rank} of world_size={self._world_size}: resuming would repeat or drop "
                    "samples. Resume with the same world size and rank, or from an epoch boundary "
                    "(a state saved between epochs restores into any world size)"
                )
        if state["seed"] is not None and self._seed is not None and state["seed"] != self._seed:
            self._adopt_seed(state["seed"])   # the plan's, and per-sample augmentation's
        order = None
        if state.get("order") is not None and getattr(self._mode, "from_sampler", False):
            from .plan import IndexOrder

            try:
                order = IndexOrder.from_state(state["order"], n)
            except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
                raise StateError(f"state's order should be what state_dict() recorded, but it is not ({e}): "
                                 "pass a dict returned by state_dict() unchanged") from None
            if batches > order.num_batches or (done and done[-1] >= order.num_batches):
                raise StateError(f"state says {batches} batches (and {done}) of an epoch of "
                                 f"{order.num_batches} were delivered: pass a dict returned by state_dict() "
                                 "unchanged")
        p = self._pass
        p.resume = {"epoch": epoch, "batches": batches, "done": frozenset(done),
                    "rng": [s.clone() for s in state["rng"]] if state.get("rng") else None, "order": order}
        p.next_epoch = epoch
        p.active = False

    def _check_source(self) -> None:
        """The user's Subsets still choose the samples this loader's copies
        read, and the datasets coordl translated still have as many: torch's
        loader would read them as they are now, coordl read them when it was
        made, so a change is an error that says so rather than a pass over
        what no longer is."""
        from torch.utils.data import ConcatDataset, Subset

        from .subsets import TwoStageConcat, TwoStageSubset

        def walk(user, mine) -> None:
            if isinstance(mine, TwoStageSubset) and isinstance(user, Subset):
                if not mine.reads(user.indices):
                    raise ValueError(
                        f"the indices of the Subset given to this DataLoader changed since the loader was made "
                        f"({len(mine._map)} samples then, {len(user.indices)} now): coordl reads a Subset's "
                        "indices when the loader is made; make a new DataLoader over the changed Subset")
                walk(user.dataset, mine.dataset)
            elif isinstance(mine, TwoStageConcat) and isinstance(user, ConcatDataset):
                for u, m in zip(user.datasets, mine.datasets):
                    walk(u, m)
            elif user is not mine and hasattr(user, "__len__"):
                if len(user) != len(mine):
                    raise ValueError(
                        f"{type(user).__name__} given to this DataLoader has {len(user)} samples now, {len(mine)} "
                        "when the loader was made: coordl reads a torchvision dataset's samples when the loader is "
                        "made; make a new DataLoader over the changed dataset")
                if callable(getattr(mine, "follow", None)):
                    mine.follow(user)     # torchvision's images in memory: their labels as they are now

        if self._wraps:
            walk(self._built_with["dataset"], self.dataset)
        src = self._tv_source
        if src is not None:
            users, mine = _leaves(src[0]), _leaves(self.dataset)
            for k, (seen, items) in self._samples_seen.items():
                now = getattr(users[k], "samples", None)
                if now is None or not callable(getattr(mine[k], "follow_samples", None)):
                    continue        # (a dataset of listed files has no samples list: its list is read once)
                # a list assigned anew, or an item of it replaced (a label, or a file: torch's next pass reads
                # it): the labels as they are now, as torch reads them, and other files an error. The items
                # are compared by identity first (C's list compare: ~4 ms a pass for 1.28M samples)
                if now is not seen or not _same_items(now, items):
                    mine[k].follow_samples(now)
                    self._samples_seen[k] = _snapshot(now)

    def _follow_torchvision(self) -> None:
        """A transform or target_transform assigned to the user's torchvision
        dataset since the last pass, or changed in place (a crop's size set
        anew: progressive resizing): translated now, so this pass runs it,
        as torch's loader would (the workers of a pass get the dataset as it
        is then; persistent ones keep theirs, as under torch).  A transform
        assigned to ``loader.dataset`` (coordl's copy) is translated too
        (:func:`coordl.tvcompat.follow_assigned`)."""
        src = self._tv_source
        if src is None:
            return
        source, followed, seen, draft = src
        users, mine = _leaves(source), _leaves(self.dataset)   # the user's datasets, coordl's copies of them
        now = [_transforms_seen(users[k]) for k in followed]
        if now == seen:
            for k in followed:
                m, given = mine[k], self._tv_assigned.get(k)
                if m.transform is self._tv_set[k] and given is not None and _spec(given[0]) != given[1]:
                    m.transform = given[0]   # the user's assigned object, changed in place: translated again
                if m.transform is not self._tv_set[k]:
                    from .tvcompat import follow_assigned

                    given = m.transform
                    translated = follow_assigned(self, draft, m)
                    self._tv_assigned[k] = (given, _spec(given)) if translated else None
                    self._tv_set[k] = m.transform
            return
        from .tvcompat import adapt, record_path

        adapted, decision = adapt(source, jpeg_draft=draft)
        if decision is None or decision.path != "coordl":
            raise ValueError(f"the transform or target_transform assigned to the loader's torchvision dataset cannot "
                             f"be run on coordl's pipeline, where the loader runs it ({decision.reason if decision else ''})"
                             ": give it a callable, or make a new DataLoader")
        fresh = _leaves(adapted)
        for k in followed:
            mine[k].take_transforms(fresh[k])
        self._tv_source = (source, followed, now, draft)
        self._tv_set = {k: mine[k].transform for k in followed}
        self._tv_assigned = {}
        record_path(self, decision)

    # ---------------------------------------------------------------- torch hooks
    def __iter__(self):
        if self._repeats_sampler():
            return _Repeating(self)
        return self._start_pass()

    def _sampler_now(self):
        """The index sampler a pass iterates: torch's (``batch_sampler``, or
        ``sampler`` without batches) as it is now, or the one the loader was
        made with where that was since replaced by an endless repeat of it
        (:meth:`_repeats_sampler`)."""
        s = _TorchDataLoader._index_sampler.fget(self)
        made = self.__dict__.get("_made_index_sampler")
        if made is not None and s is not made and getattr(s, "sampler", None) is made and not _has_len(s):
            return made
        return s

    def _repeats_sampler(self) -> bool:
        """The index sampler was replaced after the loader was made by an
        object without a length holding it as its ``sampler`` (timm's
        ``MultiEpochsDataLoader``, and the recipes that copy it, wrap it in
        a ``_RepeatSampler`` that yields it over and over, and keep one
        iterator for every epoch)."""
        return _TorchDataLoader._index_sampler.fget(self) is not self._sampler_now()

    def _start_pass(self):
        self._check_source()
        self._follow_torchvision()
        if self._peer_server is not None:
            self._peer_server.ensure()   # served again if the node daemon serving it died
        p = self._pass
        epoch = p.next_epoch
        start, skip, restore, order_restore = 0, frozenset(), None, None
        if p.resume is not None and p.resume["epoch"] == epoch:
            start, skip, restore = p.resume["batches"], p.resume["done"], p.resume["rng"]
            order_restore = p.resume.get("order")
        p.resume = None
        p.next_epoch = epoch + 1
        p.epoch, p.start, p.skip, p.yielded, p.done = epoch, start, skip, start, set(skip)
        p.rng, p.rng_restore = restore, restore
        p.order = None
        p.order_restore = order_restore
        p.active = True
        # torch's worker machinery with in_order=False delivers batches without
        # their step: the pass's progress is then unknown (see state_dict).
        p.exact = self._mode.exact_steps(self)
        self._counters.epoch = epoch
        bucket = self._counters.begin_pass(epoch, resumed=start > 0 or bool(skip))
        if self._device is not None and type(self._mode) is not PipelineMode:
            self._split_for_pass()   # nothing split: stats() says why
        prev = p.owner() if p.owner is not None else None
        inner = self._mode.start_pass(self, epoch, start, skip)
        ff = start if self._dataset_kind == _DatasetKind.Iterable else 0
        it = _LoaderIter(self, inner, epoch, ff, start, skip, bucket)
        if prev is not None and self.persistent_workers and isinstance(self._mode, PipelineMode):
            # torch's iter() of a loader with persistent workers resets and returns its one iterator: an
            # earlier one the user still holds is that same object, and goes on with the new pass (the
            # pool's batches are now the new pass's; read through the old one, they would never reach it).
            # With share=True the same: the new pass ended the old one's stream (ShareMode._end_last_pass)
            prev._successor = it
        p.owner = weakref.ref(it)
        return it

    def _device_delivery(self):
        d = self._delivery
        if d is None:
            from .device import DeviceDelivery, waits

            waits.apply(self._device)     # COORDL_CUDA_WAIT, where it is set
            d = self._delivery = DeviceDelivery(self._device, tail=self._device_tail)
        return d

    def _split_for_pass(self, split=None, dataset=None):
        """What coordl's pipeline prepares in a pass that builds its prep now
        (``split=None``: split the dataset's transform as it is now, so an
        assignment to ``dataset.transform`` takes effect at the next pass),
        or in one that reuses persistent workers (``split``: theirs).
        ``dataset``: that of the pass, where it is not ``self.dataset`` (with
        ``share=True``, persistent workers' copy as they started;
        coordl.daemon.member).  Returns the split (coordl.device.Split)."""
        from .device import delivery as _dev
        from .pipeline.collate import is_default_collate

        if split is None and dataset is not None:
            # only with share=True, where nothing is split
            split = _dev.Split(dataset, None, _NOT_SPLIT_SHARED if self._device is not None else "")
        if split is None:
            if self._device is None:
                split = _dev.Split(self.dataset, None, "")
            elif not self._mode.runs_pipeline:
                split = _dev.Split(self.dataset, None, "not split (torch's machinery reads this dataset: no "
                                                       "raw/prep, or a sampler without a length): images are "
                                                       "converted on the CPU")
            elif type(self._mode) is not PipelineMode:
                split = _dev.Split(self.dataset, None, _NOT_SPLIT_SHARED)
            elif isinstance(_inner(self.dataset), torch.utils.data.ConcatDataset):
                split = _dev.Split(self.dataset, None, "not split (a ConcatDataset, whose parts each run their own "
                                                       "transform): images are converted on the CPU")
            elif self._decode != "device" and (not is_default_collate(self.collate_fn) or not self._auto_collation):
                split = _dev.Split(self.dataset, None, "not split (a collate_fn or batch_size=None: where the "
                                                       "images land is unknown): images are converted on the CPU")
            elif self._decode == "device":
                from .device.encoded import DecodePrep, plan_for

                plan = plan_for(getattr(self.dataset, "transform", None))   # as it is now: may have changed
                plan.cpu_share = self._cpu_share
                plan.check_data = self._check_data
                split = _dev.Split(DecodePrep(self.dataset, plan), None,
                                   "not split (decode='device': images are decoded, transformed and converted "
                                   "on the device)", decode=plan)
            else:
                split = _dev.split_for_device(self.dataset, self._device)
                old = self._device_tail
                if split.tail is not None and old is not None and split.tail.normalizes == old.normalizes \
                        and split.tail.erase_value == old.erase_value and split.tail.jitter == old.jitter \
                        and split.tail.reciprocal == old.reciprocal:
                    split.tail = old    # its constants are on the device already (the same work: the same tail)
        self._device_tail = split.tail
        self._counters.device_split = split.note
        if self._delivery is not None:
            self._delivery.tail = split.tail
        if split.decode is not None:
            stage = self._decode_stage
            if stage is None or stage.plan is not split.decode:
                import functools

                from .device.decode import DecodeStage
                from .protocol import describe

                # (the stage holds the dataset, never the loader: no cycle)
                stage = self._decode_stage = DecodeStage(self._device, split.decode, self._decoder, self._on_error,
                                                         functools.partial(describe, self.dataset))
            self._counters.device_decode = stage.note()
        return split

    def _decoding(self, half, env, note: str):
        """``half(delivery, env)`` of the decode stage; a sample's error
        passes as it is (that batch fails, the pass goes on, tagged with its
        step), any other names the batch and the device."""
        from .errors import SampleError

        try:
            return half(self._device_delivery(), env)
        except SampleError:
            raise
        except Exception as e:
            raise RuntimeError(f"decoding {note} on {self._device} failed ({type(e).__name__}: {e})") from e

    def _prepare_envelope(self, env, note: str):
        """With workers and ``decode="device"``, in the fetch thread (one
        batch ahead of the decode thread): the host's work before the
        decoder's call (the streams, the rows the workers prepared), so
        that the decode thread only decodes."""
        if env.batch is not None and getattr(env.stats, "device_blob", None) is not None:
            self._decoding(self._decode_stage.prepare_envelope, env, note)
        return env

    def _decode_envelope(self, env, note: str):
        """With workers and ``decode="device"``, in the decode thread (one
        batch ahead of the pin thread): decode ``env``'s images on the
        device; the pin thread's :meth:`_stage_envelope` finishes them."""
        if env.batch is not None and getattr(env.stats, "device_blob", None) is not None:
            self._decoding(self._decode_stage.decode_envelope, env, note)
        return env

    def _stage_envelope(self, env, note: str):
        """In the pin thread: start the copy of ``env``'s batch to the device
        (with ``decode="device"``, finish the images the decode thread
        decoded, or decode them first without workers)."""
        stats = env.stats
        if self._collate_later and env.batch is not None and stats.samples:
            return self._stage_for_collate(env, note)
        return self._stage_only(env, note)

    def _stage_only(self, env, note: str):
        """:meth:`_stage_envelope`'s staging."""
        stats = env.stats
        if getattr(stats, "device_pending", None) is not None:
            env.batch = self._decoding(self._decode_stage.stage_decoded, env, note)
            return env
        if env.batch is not None and getattr(stats, "device_blob", None) is not None:
            env.batch = self._decoding(self._decode_stage.stage, env, note)
            return env
        if env.batch is not None:
            try:
                env.batch = self._device_delivery().stage(env.batch, getattr(env.stats, "device_marks", ()),
                                                          getattr(env.stats, "device_after", None))
            except Exception as e:
                raise RuntimeError(f"copying {note} to {self._device} failed ({type(e).__name__}: {e})") from e
        return env

    def _stage_for_collate(self, env, note: str):
        """:meth:`_stage_envelope` of a batch whose ``collate_fn`` runs after
        the device stage (``decode="device"`` with a ``collate_fn``): stage
        the default-collated batch as usual, then make the samples the
        ``collate_fn`` gets (``stats.device_samples``, here, off the
        training thread): the images as rows of the device's batch, every
        other leaf a copy of the host's, of the kind the dataset returned
        (:func:`coordl.pipeline.collate.samples_of`)."""
        from .pipeline.collate import samples_of

        stats = env.stats
        decoding = stats.device_blob is not None or stats.device_pending is not None
        images = tuple(stats.device_marks) if decoding else ()
        if stats.device_blob is not None:      # without workers: the decode's first half here, first
            self._decoding(self._decode_stage.decode_envelope, env, note)
        host = env.batch                       # (after that half: the rows it kept)
        env = self._stage_only(env, note)
        if env.batch is not None:
            stats.device_samples = samples_of(env.batch.batch, host, stats.layout, images)
        return env

    def _collate_delivered(self, batch, env):
        """``decode="device"`` with a ``collate_fn``: ``batch`` (handed over
        to the training stream) is the device stage's default collation;
        return ``collate_fn`` of its samples (``env.stats.device_samples``),
        run here, in the training loop's thread, on its stream, with the
        global generators seeded from the batch's (seed, epoch, step) as in
        the workers (:func:`coordl._rng.seeded_collate`), and its result's
        CPU tensors moved to the device.  An error of the ``collate_fn``
        fails this batch, as under torch; the pass goes on."""
        from . import _rng
        from .device.delivery import _move_object, walk

        samples, env.stats.device_samples = env.stats.device_samples, None
        del batch       # its images are the samples' (the hand-over kept them for the training stream)
        try:
            with _rng.seeded_collate(self.seed, env.epoch, env.step) if _rng.collate_draws(self.collate_fn) \
                    else contextlib.nullcontext():
                out = self.collate_fn(samples)
        except Exception as e:
            e.add_note(f"(coordl: in collate_fn, called with decode='device' on the samples of step {env.step}, "
                       f"their images already on {self._device}; for a collate_fn that needs them on the CPU, "
                       "use decode='cpu')")
            raise
        device = self._device
        return walk(out, lambda t: t if t.device == device else t.to(device, non_blocking=True),
                    lambda o: _move_object(o, device))

    def _deliver(self, batch, marks=(), after=None):
        """Hand ``batch`` to the device (coordl.device): coordl's pipeline's
        through the pinned ring (already staged by the pin thread, or staged
        here, without workers); a batch of torch's machinery straight from
        the page-locked memory torch's pin thread put it in."""
        from .device import Staged

        d = self._device_delivery()
        if type(batch) is Staged:
            return d.hand_over(batch)
        if self._mode.runs_pipeline:
            return d.deliver(batch, marks, after)
        return d.send(batch)

    def _setup_peers(self, peers) -> None:
        """Agree on the peer table over torch.distributed (collective when the
        process group spans several ranks); start this node's cache server
        when this rank is the node's lowest."""
        from .peers import rendezvous

        spec = self._cache_spec()
        p = self._plan
        plan_kwargs = dict(num_samples=p.num_samples, seed=p.seed, batch_size=p.batch_size,
                           shuffle=p.shuffle, drop_last=p.drop_last)
        client, server = rendezvous.setup(peers, self._cache, spec["fingerprint"] if spec else None, plan_kwargs,
                                          self._rank, self._world_size, cache_spec=spec, share=bool(self._share))
        self._peers, self._peer_server = client, server
        if client is not None:
            weakref.finalize(self, _reaper.later, client.close)
        if server is not None:
            weakref.finalize(self, _reaper.later, server.close)

    def _cache_spec(self) -> dict | None:
        """How another process of this user attaches this loader's node cache
        (``NodeCache.from_spec``): the daemon, its workers, a peer server."""
        if self._cache is None:
            return None
        checksum, keep_warm = self._cache_opts
        return {"fingerprint": self.dataset.fingerprint(), "n": len(self.dataset), "capacity": self._cache_size,
                "checksum": checksum, "keep_warm": keep_warm}

    @property
    def peer_server(self):
        """This node's cache server when this rank is the node's lowest (else
        None): a ``PeerServer`` in this process, or the node daemon's
        (``in_daemon``).  ``address`` is where it listens."""
        return self._peer_server

    def _attach_cache(self):
        """Attach to (or create) the node cache before training starts, so a
        /dev/shm too small for it fails now, with the remedy.  This loader's
        hold on it ends when the loader is collected; the segment itself goes
        only when no loader, worker or job holds it any more."""
        from .cache import NodeCache

        checksum, keep_warm = self._cache_opts
        _reaper.start()
        # the holds of loaders collected before this one (queued for the reaper) go first: a loader made
        # after another's `del` finds the cache as that del left it (gone with its last holder, unless
        # cache_keep_warm), not warm or cold by the reaper's timing
        _reaper.flush(_REAPER_WAIT)
        cache = NodeCache.attach(self.dataset.fingerprint(), len(self.dataset), self._cache_size,
                                 checksum=checksum, keep_warm=keep_warm)
        weakref.finalize(self, _reaper.later, cache.close)  # finalizers only enqueue
        return cache

    def _get_iterator(self):
        # torch's hook for building its iterator (torch-machinery modes only);
        # it forks torch's workers: they must never collect what they inherit
        with starting_workers():
            if self._device is not None and self._device.type == "cuda" and not self.pin_memory:
                # device=: torch's pin thread puts batches in page-locked memory, off the
                # training thread, and the copy to the device starts from there (coordl.device)
                d = self.__dict__
                d["pin_memory"] = True
                try:
                    return self._mode.build_torch_iterator(self)
                finally:
                    d["pin_memory"] = False
            return self._mode.build_torch_iterator(self)

    @property
    def _index_sampler(self):
        ps = self.__dict__.get("_pass_sampler")
        if ps is None:  # during torch's __init__
            return _TorchDataLoader._index_sampler.fget(self)
        return ps

    # ---------------------------------------------------------------- internals
    def _dataset_len(self) -> int | None:
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def _dataset_identity(self) -> str | None:
        """What the state says the dataset is: its samples (relative paths,
        class indices, sizes) for a folder dataset, else its
        ``fingerprint()``; None when it has neither (nothing is checked)."""
        ds = self.dataset
        fn = getattr(ds, "sample_digest", None)
        kind = "samples"
        if not callable(fn):
            fn, kind = getattr(ds, "fingerprint", None), "fingerprint"
        if not callable(fn):
            return None
        try:
            return f"{kind} {fn()}"
        except Exception:   # a dataset whose identity cannot be computed: nothing to check
            return None

    def _adopt_seed(self, seed: int) -> None:
        self._seed = seed
        if self._plan is not None:
            from dataclasses import replace
            self._plan = replace(self._plan, seed=seed)
        self._mode.adopt_seed(self, seed)

    def _rng_generators(self) -> list[torch.Generator]:
        gens: list[torch.Generator] = []
        for g in (self.generator, getattr(self.sampler, "generator", None),
                  getattr(getattr(self.batch_sampler, "sampler", None), "generator", None)):
            if isinstance(g, torch.Generator) and all(g is not h for h in gens):
                gens.append(g)
        gens.append(torch.default_generator)
        return gens

    def _count_samples(self, batch) -> int:
        if not self._auto_collation:     # batch_size=None without a batch_sampler: samples one by one
            return 1
        t = _first_tensor(batch)
        if t is not None:
            # size(0), not shape[0]: a strided nested tensor has no sizes
            return int(t.size(0)) if t.dim() > 0 else 1
        try:
            return len(batch)
        except TypeError:
            return 1


def _inner(ds):
    """The dataset inside torch's ``Subset`` (and coordl's TwoStageSubset),
    however deep, or ``ds``."""
    from torch.utils.data import Subset

    while isinstance(ds, Subset):
        ds = ds.dataset
    return ds


def _leaves(ds) -> list:
    """The datasets inside torch's ``Subset`` and ``ConcatDataset`` (and
    coordl's two-stage ones of them), in order, or ``[ds]``."""
    from torch.utils.data import ConcatDataset

    ds = _inner(ds)
    if isinstance(ds, ConcatDataset):
        return [leaf for d in ds.datasets for leaf in _leaves(d)]
    return [ds]


def _spec(t):
    from .transforms import spec_of

    return spec_of(t) if t is not None else None


def _transforms_seen(ds) -> tuple:
    """What decides a torchvision dataset's translation: its transform and
    target_transform objects, and their descriptions (their parameters:
    ``coordl.transforms.spec_of``), so that one assigned anew or changed in
    place reads as changed; and its joint ``transforms`` object (what
    ``Places365`` and ``OxfordIIITPet`` apply); for timm's ``AugMixDataset``
    (which has no target_transform of its own), its augmentation,
    normalize and number of views."""
    from .transforms import spec_of

    t, tt = ds.transform, getattr(ds, "target_transform", None)
    return (id(t), spec_of(t) if t is not None else None, id(tt), spec_of(tt) if tt is not None else None,
            id(getattr(ds, "transforms", None)), id(getattr(ds, "augmentation", None)),
            id(getattr(ds, "normalize", None)), getattr(ds, "num_splits", None), _holder_spec(t))


def _holder_spec(t) -> tuple | None:
    """For an object of a user's class holding transforms (a transform that
    makes several views of each image: ``coordl.tvcompat.MultiViews``),
    what its attributes are now (the transforms it holds by ``spec_of``,
    with their parameters; numbers, strings and None by value, such as its
    number of views; anything else by identity), so that one changed in
    place reads as changed; None for anything else."""
    from .transforms import spec_of

    d = getattr(t, "__dict__", None)
    mod = type(t).__module__
    if not isinstance(d, dict) or mod.split(".")[0] in ("torchvision", "coordl", "timm", "torch") \
            or isinstance(t, types.FunctionType):
        return None
    try:
        return tuple((k, spec_of(v) if callable(v) else v if v is None or isinstance(v, (bool, int, float, str))
                      else ("id", id(v))) for k, v in d.items())
    except Exception:  # noqa: BLE001 - an attribute without a description: the object itself is compared
        return None


# DataLoader.__init__'s parameters, torch's and coordl's
_INIT_PARAMETERS = tuple(inspect.signature(DataLoader.__init__).parameters)[1:]


def _built_again(cls, args: dict, state: dict) -> "DataLoader":
    """A pickled loader (:meth:`DataLoader.__reduce__`): built with its arguments, then at its state."""
    loader = cls(**args)
    loader.load_state_dict(state)
    return loader


class _Repeating:
    """The iterator of a loader whose index sampler repeats endlessly
    (:meth:`DataLoader._repeats_sampler`): the loader's passes one after the
    other, each an epoch of its own (the next epoch's order, draws and
    statistics, its workers kept where ``persistent_workers``), as torch's
    one iterator over the repeating sampler goes on.  A pass that delivers
    nothing ends it (torch's would wait forever)."""

    def __init__(self, loader) -> None:
        self._loader_ref = weakref.ref(loader)   # (the loader holds this iterator: timm's does)
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        fresh = False
        while True:
            if self._it is None:
                loader = self._loader_ref()
                if loader is None:
                    raise StopIteration
                self._it, fresh = loader._start_pass(), True
                del loader
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                if fresh:
                    raise

    def __len__(self) -> int:
        loader = self._loader_ref()
        return len(loader._sampler_now()) if loader is not None else 0


def _has_len(sampler) -> bool:
    """Whether an index sampler says how many steps it yields (``len``):
    then coordl's pipeline reads each pass's order from it."""
    try:
        len(sampler)
    except TypeError:
        return False
    return True


def _peek_seed(generator) -> int:
    """A seed from ``generator`` (torch's global one when None) that leaves
    it where it was: a copy of its state draws, and the value is mixed so it
    is not the draw the generator itself will make next."""
    src = generator if generator is not None else torch.default_generator
    g = torch.Generator()
    g.set_state(src.get_state())
    v = int(torch.empty((), dtype=torch.int64).random_(generator=g).item())
    # splitmix64's finalizer
    v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    v = (v ^ (v >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return (v ^ (v >> 31)) & ((1 << 63) - 1)


def _parse_device(device, decode: str = "cpu") -> torch.device | None:
    """The delivery device, or None where batches stay where they are
    (``device="cpu"``, except with ``decode="device"``: the device path runs
    on the CPU, a CPU decoder standing in for the GPU's, as in CI)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f'device should be None, a torch.device or a string like "cuda", "cuda:0" or "cpu", '
            f"but got device={device!r} ({e})"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device should be a device this machine has, but got device={device!r} while "
            "torch.cuda.is_available() is False: pass device=None or 'cpu'"
        )
    if dev.type == "cpu":
        from .device import delivery as _dev

        # batches are already on the CPU; decode="device" (and the test seam) run the device path on it
        return dev if _dev.CPU_TEST_DEVICE or decode == "device" else None
    return dev


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size should be a positive int, but got world_size={world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank should be an int in [0, world_size={world_size}), but got rank={rank!r}")
    return rank, world_size


_SEED_COUNTS: dict[str, int] = {}   # loaders of this process per seed key (see _agree_on_seed)


def _agree_on_seed(seed: int, dataset, rank: int, world_size: int, plan: tuple) -> int:
    """The seed of an unseeded loader whose plan spans the ranks of a
    torch.distributed job: rank 0's, passed over the process group's
    key-value store, not a collective, so building a loader on some ranks
    only never hangs the ones that build it (an evaluation loader on rank 0).

    Rank 0 publishes its seed under a key naming what the plan is of
    (dataset, plan settings, world size, and how many such loaders this
    process built before) and goes on; every other rank waits for that key,
    within ``COORDL_PEER_RENDEZVOUS_TIMEOUT`` seconds (default 300), and
    fails clearly if rank 0 never builds that loader.  A loader with its own
    ``seed=`` (or a plan of one rank) talks to nobody."""
    if world_size < 2 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        return seed
    import datetime
    import hashlib

    from torch.distributed import distributed_c10d as c10d

    fp = getattr(dataset, "fingerprint", None)
    try:
        what = fp() if callable(fp) else f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    except Exception:
        what = type(dataset).__qualname__
    desc = repr((what, len(dataset), plan, world_size))
    key = hashlib.blake2b(desc.encode(), digest_size=12).hexdigest()
    n = _SEED_COUNTS[key] = _SEED_COUNTS.get(key, 0) + 1
    name = f"coordl/seed/{key}/{n}"
    store = c10d._get_default_store()
    if rank == 0:
        store.set(name, str(seed))
        return seed
    from .peers.rendezvous import env_settings

    timeout = env_settings().get("rendezvous_timeout") or 300.0
    try:
        store.wait([name], datetime.timedelta(seconds=timeout))
        return int(store.get(name).decode())
    except RuntimeError as e:   # the deadline passed (DistStoreError), or rank 0's store went away
        raise RuntimeError(
            f"coordl: this rank ({rank}) built a DataLoader without seed= whose plan spans the "
            f"{world_size} ranks, and rank 0 did not build the same one within {timeout:g} s (it gives "
            "the seed every rank shuffles with); build it on rank 0 too, or pass the same seed= on every "
            f"rank (COORDL_PEER_RENDEZVOUS_TIMEOUT sets the wait) [{type(e).__name__}: {e}]") from None
