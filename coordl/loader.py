"""``coordl.DataLoader``: torch's DataLoader, plus the epoch plan, two-stage
fetch/prep, resumable state and statistics.

How a loader decides what to do (see docs/architecture.md for the diagram):

* **Order.**  With no ``sampler``/``batch_sampler`` and either a two-stage
  dataset or an explicit ``seed``, the order is coordl's epoch plan, a pure
  function of (seed, epoch, rank, world_size).  Otherwise torch's own samplers
  run, untouched, so a script that worked under torch sees the same batches.
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

import itertools
import weakref
import time
import warnings
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data.dataloader import _DatasetKind

from .base import reaper as _reaper
from .device import pin as _pin
from .pipeline.modes import PipelineMode, choose_mode
from .pipeline.torch_path import Envelope, Task
from .base.units import parse_size
from .errors import SkippedSampleWarning, StateError
from .plan import EpochPlan, check_seed
from .protocol import is_two_stage
from .stats import Counters, LoaderStats

__all__ = ["DataLoader"]

_T_co = TypeVar("_T_co", covariant=True)

_STATE_FORMAT = "coordl.DataLoader"
_STATE_VERSION = 2  # 2 added "done"; version 1 states (no "done") still load
_END = object()


class _Pass:
    """Book-keeping of the loader's passes (epochs) and pending resume.

    Which steps (batch indices) of the pass were delivered is kept as a
    contiguous prefix ``yielded`` plus the set ``done`` of steps delivered
    beyond it (out-of-order delivery, ``in_order=False``).  A step counts as
    delivered when the loop received its batch, or when all its samples were
    skipped (``on_error="skip"``): either way a resumed pass must not redo it.
    """

    def __init__(self) -> None:
        self.next_epoch = 0
        self.resume: dict | None = None
        self.epoch = 0
        self.start = 0
        self.skip: frozenset = frozenset()  # steps beyond `start` done before a resume
        self.yielded = 0
        self.done: set[int] = set()
        self.active = False
        self.exact = True  # False: torch hands batches over out of order, steps unknown
        self.rng: list | None = None  # torch-sampler RNG states at pass start
        self.rng_restore: list | None = None
        self.owner = None  # weakref to the _LoaderIter of the current pass

    def live(self) -> bool:
        """A pass is in progress while its iterator exists and has not ended.

        Once the iterator is gone (a ``for`` loop left by ``break``, a
        ``zip`` that stopped), nothing can deliver the rest of that pass: the
        loader's next pass is the next epoch, and that is what the state says.
        """
        return self.active and self.owner is not None and self.owner() is not None

    def mark(self, k: int) -> None:
        if k == self.yielded:
            self.yielded += 1
            while self.yielded in self.done:
                self.done.discard(self.yielded)
                self.yielded += 1
        elif k > self.yielded:
            self.done.add(k)


class _PassSampler:
    """The index sampler torch's iterator sees: yields the current pass's steps.

    One persistent object per loader, because torch's persistent-workers
    iterator keeps the index sampler it was built with and calls ``iter()`` on
    it again each epoch; each ``iter()`` reads the pass the loader is on.
    """

    def __init__(self, loader: "DataLoader") -> None:
        # weak: a loader <-> sampler cycle would keep a dead loader's worker
        # iterator alive until a gc run, possibly inside a forked worker.
        self._loader_ref = weakref.ref(loader)

    def __len__(self) -> int:
        L = self._loader_ref()
        if L._plan is not None:
            return L._plan.num_batches
        return len(_TorchDataLoader._index_sampler.fget(L))

    def __iter__(self):
        # The generators below must not hold the loader: with persistent
        # workers torch keeps them in the loader's iterator (a cycle).
        L = self._loader_ref()
        p = L._pass
        epoch, start, skip = p.epoch, p.start, p.skip
        if L._plan is not None:
            it = L._plan.batches(epoch, start)
        else:
            it = _torch_steps(
                _TorchDataLoader._index_sampler.fget(L), L._rng_generators(), p,
                start if L._dataset_kind != _DatasetKind.Iterable else 0,
            )
        if skip:
            it = _without(it, start, skip)
        return _tag(epoch, it) if L._mode.tag_tasks else it


def _without(steps, start: int, skip: frozenset):
    for k, x in enumerate(steps, start):
        if k not in skip:
            yield x


def _tag(epoch: int, steps):
    for x in steps:
        yield Task(epoch, x)


def _torch_steps(index_sampler, gens: list, p: _Pass, start: int):
    """torch's own index sampler for this pass, skipping ``start`` steps.

    The RNG states the sampler draws from are captured just before its first
    draw (so a state dict can replay the same order) or, when resuming, set to
    the saved ones for that draw; torch's global RNG is then put back as it
    was, so resuming never disturbs the user's random stream.
    """
    restore = p.rng_restore
    p.rng_restore = None
    if restore is not None and len(restore) == len(gens):
        user_global = torch.default_generator.get_state()
        for g, s in zip(gens, restore):
            g.set_state(s)
        p.rng = restore
    else:
        restore = None
        p.rng = [g.get_state() for g in gens]
    it = iter(index_sampler)
    first = next(it, _END)
    if restore is not None:
        torch.default_generator.set_state(user_global)
    if first is _END:
        return
    steps = itertools.chain((first,), it)
    if start:
        steps = itertools.islice(steps, start, None)
    yield from steps


class _LoaderIter:
    """Wraps the iterator of one pass (torch's, or coordl's pipeline):
    counts, times, unwraps, delivers.

    It also carries the attributes of torch's own iterator
    (``_BaseDataLoaderIter`` / ``_MultiProcessingDataLoaderIter``) that tests
    and libraries reach for, with torch's meaning on every placement:
    ``_workers`` (the worker processes; empty without workers),
    ``_num_yielded`` (batches this iterator returned), ``_shutdown_workers()``
    (stop the workers; the pass then ends), ``_dataset``/``_collate_fn`` (the
    user's, not coordl's wrappers), ``_index_sampler``, ``_num_workers``,
    ``_pin_memory`` and the other settings.
    """

    def __init__(self, loader: "DataLoader", inner, epoch: int, fast_forward: int,
                 start: int = 0, skip: frozenset = frozenset(), bucket: dict | None = None) -> None:
        self._loader = loader
        self._inner = inner
        self._epoch = epoch
        # this pass's record in the loader's statistics (stats().epochs)
        self._bucket = loader._counters.bucket(epoch) if bucket is None else bucket
        self._ff = fast_forward
        self._seq = start   # next step in plan order, for batches that do not say theirs
        self._skip = skip
        self._num_yielded = 0
        self._stopped = False  # _shutdown_workers() was called
        self._t_first = None   # when the training loop first asked (wall time of the pass)
        self._wall_base = 0.0
        self._bar = None       # progress bar (progress=True)
        self._pass_samples = 0     # this pass's own samples and wait, for the bar
        self._pass_wait = 0.0
        self._start_done = start + len(skip)   # steps of the epoch done before this pass

    def __iter__(self) -> "_LoaderIter":
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __next__(self) -> Any:
        L = self._loader
        counters = L._counters
        clock = time.perf_counter
        t0 = clock()
        if self._t_first is None:
            self._t_first = t0
            self._wall_base = self._bucket["wall_seconds"]
            if L._progress:
                self._open_bar()
        try:
            while True:
                if self._stopped:
                    raise StopIteration
                data = next(self._inner)
                if self._ff:
                    self._ff -= 1
                    continue
                if type(data) is Envelope:
                    self._absorb(data)
                    self._delivered(data.step)
                    if data.batch is None:  # every sample of the step was skipped
                        continue
                    batch, n, marks = data.batch, data.stats.samples, getattr(data.stats, "device_marks", ())
                else:
                    self._delivered(None)
                    batch, n, marks = data, L._count_samples(data), ()
                break
        except StopIteration:
            t1 = clock()
            counters.wait_seconds += t1 - t0
            b = self._bucket
            b["wait_seconds"] += t1 - t0
            b["wall_seconds"] = self._wall_base + (t1 - self._t_first)   # the pass ends here
            if L._pass.owner() is self:
                L._pass.active = False
            if self._bar is not None:
                self._pass_wait += t1 - t0
                self._show_rates(t1)
                self._bar.close()   # stays on screen (leave=True) with the pass's final rates
                self._bar = None
            raise
        except Exception as e:
            # A batch that failed (a bad sample, an error in the user's
            # dataset or collate_fn) is used up, as under torch: the pass goes
            # on with the next batch, and the state must not redo this one.
            t1 = clock()
            counters.wait_seconds += t1 - t0
            self._bucket["wait_seconds"] += t1 - t0
            if _batch_failed(e, L._mode.runs_pipeline):
                self._delivered(getattr(e, "coordl_step", None))
            raise
        t1 = clock()
        if L._device is not None:
            batch = L._deliver(batch, marks)
        bucket = self._bucket
        bucket["samples"] += n
        bucket["batches"] += 1
        t2 = clock()
        counters.wait_seconds += t1 - t0
        counters.deliver_seconds += t2 - t1
        bucket["wait_seconds"] += t1 - t0
        bucket["wall_seconds"] = self._wall_base + (t2 - self._t_first)
        self._num_yielded += 1
        bar = self._bar
        if bar is not None:
            self._pass_samples += n
            self._pass_wait += t1 - t0
            if time.time() - bar.last_print_t >= bar.mininterval:
                self._show_rates(t2)   # tqdm redraws in this update: both rates of one moment
            bar.update(1)
        return batch

    def _open_bar(self) -> None:
        """The pass's progress bar (``progress=True``), opened when the pass
        starts.  Its batches/s and the samples/s beside it are both this
        pass's averages since that moment (tqdm's ``smoothing=0``), so
        samples/s is batches/s times the samples per batch; the bar stays on
        screen when the pass ends (``leave=True``)."""
        from tqdm.auto import tqdm

        try:
            total = len(self)
        except TypeError:
            total = None
        initial = min(self._start_done, total) if total is not None else 0
        # redrawn at most twice a second: the postfix costs more than the bar
        self._bar = tqdm(total=total, initial=initial, unit="batch", desc=f"epoch {self._epoch}",
                         leave=True, smoothing=0, mininterval=0.5, miniters=1, dynamic_ncols=True)

    def _show_rates(self, now: float) -> None:
        """Set the postfix for the bar's next redraw: samples/s over tqdm's
        own elapsed time (the one its batches/s is computed over), and the
        stall over this pass's wall time."""
        bar = self._bar
        elapsed = time.time() - bar.start_t
        wall = now - self._t_first
        bar.set_postfix_str(f"{self._pass_samples / elapsed if elapsed > 0 else 0:.0f} samples/s, "
                            f"stall {100 * self._pass_wait / wall if wall > 0 else 0:.0f}%", refresh=False)

    # ----------------------------------------------- torch's iterator attributes
    @property
    def _workers(self) -> list:
        """The worker processes of this pass (``multiprocessing.Process``)."""
        inner = self._inner
        if hasattr(inner, "worker_processes"):  # coordl's pipeline
            return inner.worker_processes()
        return getattr(inner, "_workers", [])

    def _shutdown_workers(self) -> None:
        """Stop this pass's worker processes now (torch's name); the pass ends."""
        self._stopped = True
        inner = self._inner
        fn = getattr(inner, "shutdown_workers", None) or getattr(inner, "_shutdown_workers", None)
        if fn is not None:
            fn()
        if self._loader._iterator is inner:  # torch's persistent iterator: start anew next pass
            self._loader._iterator = None
        p = self._loader._pass
        if p.owner() is self:
            p.active = False

    @property
    def _shutdown(self) -> bool:
        return self._stopped or bool(getattr(self._inner, "_shutdown", False))

    def __getattr__(self, name: str):
        # torch's iterator settings, read from the loader (the user's
        # dataset and collate_fn, never coordl's wrappers)
        src = _FROM_LOADER.get(name)
        if src is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._loader, src)

    @property
    def _pin_memory(self) -> bool:
        """Whether this pass pins batches (asked for, and an accelerator exists)."""
        return self._loader.pin_memory and _pin.accelerator_available()

    @property
    def _pin_memory_device(self):
        if not self._pin_memory:
            return None
        acc = torch.accelerator.current_accelerator()
        return acc.type if acc is not None else None

    @property
    def _base_seed(self):
        seed = getattr(self._inner, "_base_seed", None)
        return seed if seed is not None else getattr(self._inner, "base_seed", None)

    @property
    def _worker_pids_set(self) -> bool:
        if hasattr(self._inner, "_worker_pids_set"):
            return self._inner._worker_pids_set
        return bool(self._workers)

    def _delivered(self, k: int | None) -> None:
        if k is None:  # delivered in plan order: the next step not done before
            while self._seq in self._skip:
                self._seq += 1
            k = self._seq
            self._seq += 1
        p = self._loader._pass
        if p.owner() is self:
            p.mark(k)

    def _absorb(self, env: Envelope) -> None:
        # epoch -1: torch's machinery ran a generic dataset (on_error="skip"), whose I/O coordl cannot see
        counters = self._loader._counters
        b = self._bucket if env.epoch in (-1, self._epoch) else counters.bucket(env.epoch)
        counters.absorb(env.stats, b, reads_seen=env.epoch >= 0)
        for index, where, err in env.stats.skips:
            warnings.warn(
                f"coordl: skipped sample {index} ({where}) after an error {err}",
                SkippedSampleWarning,
                stacklevel=3,
            )


# torch iterator attribute -> the loader attribute it equals
_FROM_LOADER = {
    "_dataset": "dataset", "_collate_fn": "collate_fn", "_dataset_kind": "_dataset_kind",
    "_auto_collation": "_auto_collation", "_drop_last": "drop_last", "_index_sampler": "_index_sampler",
    "_IterableDataset_len_called": "_IterableDataset_len_called", "_num_workers": "num_workers",
    "_prefetch_factor": "prefetch_factor", "_persistent_workers": "persistent_workers",
    "_in_order": "in_order", "_timeout": "timeout", "_worker_init_fn": "worker_init_fn",
    "_multiprocessing_context": "multiprocessing_context", "_world_size": "_world_size", "_rank": "_rank",
}


def _batch_failed(e: Exception, pipeline: bool) -> bool:
    """Whether ``e`` is one batch's failure (the pass goes on), not the end of
    the pass: coordl's pipeline tags a failed batch with its step (anything
    else it raises ends the pass); torch's iterators raise the worker's or
    dataset's own error for the next batch in order, and say "DataLoader
    worker ... exited" / "DataLoader timed out" when the pass itself failed."""
    if hasattr(e, "coordl_step") or pipeline:
        return hasattr(e, "coordl_step")
    return not (isinstance(e, RuntimeError) and str(e).startswith(("DataLoader ", "this DataLoader pass")))


def _first_tensor(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        return obj
    if depth > 4:
        return None
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for v in obj:
            t = _first_tensor(v, depth + 1)
            if t is not None:
                return t
    return None


class DataLoader(_TorchDataLoader[_T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` that stops training waiting for data.

    Every positional and keyword parameter of torch's DataLoader is accepted
    with the same default and validated by torch itself.  Keyword-only extras:

    seed
        Seed of the epoch plan and of per-sample augmentation generators.  For
        a two-stage dataset, ``None`` draws one from ``generator`` (or torch's
        global RNG, so ``torch.manual_seed`` controls it).  For any other
        map-style dataset, giving a seed opts into coordl's epoch plan (order a
        pure function of seed and epoch, exact resume); ``None`` keeps torch's
        samplers.
    cache_size
        Node cache budget: bytes, ``"20GiB"``, ``"512MB"`` or ``"50%"`` of
        available memory; ``0``/``None`` disables it.  Reserved in full in
        ``/dev/shm/coordl-<uid>/`` when the loader is created (a full
        ``/dev/shm`` raises ``MemoryError`` here); see docs/api.md.
    cache_checksum, cache_keep_warm
        Raise on a hit whose CRC32 does not match; seconds the cache
        outlives its last user (see docs/api.md, "Node cache").
    device
        Deliver batches on this device (``"cuda"``, ``"cuda:1"``, ``"cpu"``);
        with CUDA, batches are pinned and copied with ``non_blocking=True``
        on a side stream, and a coordl ``Compose`` ending in ``ToTensor`` and
        ``Normalize`` is split so uint8 images travel (docs/api.md).
    on_error
        ``"raise"`` (default): a bad sample raises ``SampleError`` naming its
        index and path, which is also an instance of the sample's own error
        type (``except OSError`` works, as under torch).  ``"skip"``: drop it, warn once
        (``SkippedSampleWarning``) and count it in ``stats().skipped``.
    rank, world_size
        The epoch plan's partition; default from ``torch.distributed`` when it
        is initialized, else 0 and 1.
    read_ahead
        Byte budget of the fetch stage's read-ahead (all workers together;
        default ``"64MiB"``).
    fetch_threads
        Fetch threads per worker; default 8 for local files, 16 for URLs
        read through fsspec (each reads batches of up to 8 objects), 64 for
        URLs read through obstore (one object each).  Reads per second ~
        reads in flight / storage latency.
    share
        Prepare samples once for every job on the node that reads the same
        dataset with the same transforms, seed, shuffle and partition,
        through the node daemon (``coordl daemon``; started detached if none
        runs).  Batches are bit-identical to ``share=False``.  ``None``
        (default): ``True`` when the environment has ``COORDL_SHARE=1``.
        See docs/api.md, "Sharing prep across jobs".
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
        another loader, is an error on every rank.  See docs/api.md,
        "Across nodes".
    progress
        Show a progress bar per epoch (tqdm) with samples/s and the data
        stall (the share of the time the training loop waited in
        ``next()``).
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
    ) -> None:
        from .tvcompat import adapt, record_path

        # torchvision's ImageFolder/DatasetFolder -> coordl's two-stage dataset (see coordl/tvcompat.py)
        dataset, tv_decision = adapt(dataset)
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
            pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
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
                              "no progress bar is shown", stacklevel=2)
                progress = False
        self._progress = progress
        self._device = _parse_device(device)
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

        iterable = self._dataset_kind == _DatasetKind.Iterable
        user_sampler = sampler is not None or batch_sampler is not None
        two_stage = not iterable and is_two_stage(dataset)
        if iterable and on_error == "skip":
            raise ValueError(
                'on_error should be "raise" for an IterableDataset (its errors come from its own '
                'iterator, which coordl cannot resume past), but got on_error="skip"'
            )
        plan_order = not iterable and not user_sampler and (two_stage or seed is not None)
        self._rank, self._world_size = _rank_and_world(rank, world_size)
        if (plan_order or two_stage) and seed is None:
            seed = _agree_on_seed(int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()),
                                  dataset, self._rank, self._world_size,
                                  (batch_size, bool(shuffle), drop_last))
        self._seed = seed
        self._plan = None
        if plan_order:
            self._plan = EpochPlan(
                num_samples=len(dataset), seed=seed, batch_size=batch_size,
                shuffle=bool(shuffle), drop_last=drop_last,
                rank=self._rank, world_size=self._world_size,
            )
        self._mode = choose_mode(dataset, two_stage=two_stage, plan_order=plan_order,
                                 user_sampler=user_sampler, iterable=iterable, on_error=on_error,
                                 seed=seed, collate_fn=self.collate_fn, user_collate=collate_fn is not None,
                                 batch_size=batch_size)
        from .daemon.member import ShareMode, share_requested

        self._share = share_requested(share)
        if self._share and isinstance(self._mode, PipelineMode):
            self._mode = ShareMode()
        elif self._share and share is not None:
            warnings.warn(
                "share=True has no effect here: the node daemon prepares samples of two-stage datasets "
                "(raw/prep) read in coordl's epoch-plan order; this loader "
                f"{'has a user sampler' if user_sampler else 'reads a dataset without raw/prep'}",
                stacklevel=2)
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
                stacklevel=2)
        self._peers = self._peer_server = None
        if isinstance(self._mode, PipelineMode):
            self._setup_peers(peers)
        elif peers not in (None, "auto", "off"):
            from .peers.rendezvous import _want

            _want(peers)   # a bad value is an error everywhere
            warnings.warn(f"peers={peers!r} has no effect here: peers serve node caches of two-stage datasets "
                          "(raw/prep) read in coordl's epoch-plan order", stacklevel=2)
        self._pass = _Pass()
        self._pass_sampler = _PassSampler(self)
        self._counters = Counters()
        record_path(self, tv_decision)

    # ------------------------------------------------------------------ public
    @property
    def seed(self) -> int | None:
        """The seed of the epoch plan / per-sample generators (None: torch's samplers)."""
        return self._seed

    @property
    def cache_size(self) -> int:
        """Node cache budget in bytes (0: disabled)."""
        return self._cache_size

    @property
    def device(self) -> torch.device | None:
        return self._device

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
        if p.live():
            epoch, batches, done, rng = p.epoch, p.yielded, sorted(p.done), p.rng
            complete = self._plan is not None and batches >= self._plan.num_batches
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
            done = list(p.resume["done"])
        else:
            epoch, batches, done, rng = p.next_epoch, 0, [], None
        if self._plan is not None and batches >= self._plan.num_batches:
            epoch, batches, done, rng = epoch + 1, 0, [], None
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
        if mode == "plan" and state["seed"] != self._seed:
            self._adopt_seed(state["seed"])
        p = self._pass
        p.resume = {"epoch": epoch, "batches": batches, "done": frozenset(done),
                    "rng": [s.clone() for s in state["rng"]] if state.get("rng") else None}
        p.next_epoch = epoch
        p.active = False

    # ---------------------------------------------------------------- torch hooks
    def __iter__(self):
        if self._peer_server is not None:
            self._peer_server.ensure()   # served again if the node daemon serving it died
        p = self._pass
        epoch = p.next_epoch
        start, skip, restore = 0, frozenset(), None
        if p.resume is not None and p.resume["epoch"] == epoch:
            start, skip, restore = p.resume["batches"], p.resume["done"], p.resume["rng"]
        p.resume = None
        p.next_epoch = epoch + 1
        p.epoch, p.start, p.skip, p.yielded, p.done = epoch, start, skip, start, set(skip)
        p.rng, p.rng_restore = restore, restore
        p.active = True
        # torch's worker machinery with in_order=False delivers batches without
        # their step: the pass's progress is then unknown (see state_dict).
        p.exact = self._mode.exact_steps(self)
        self._counters.epoch = epoch
        bucket = self._counters.begin_pass(epoch, resumed=start > 0 or bool(skip))
        if self._device is not None and type(self._mode) is not PipelineMode:
            self._split_for_pass()   # nothing split: stats() says why
        inner = self._mode.start_pass(self, epoch, start, skip)
        ff = start if self._dataset_kind == _DatasetKind.Iterable else 0
        it = _LoaderIter(self, inner, epoch, ff, start, skip, bucket)
        p.owner = weakref.ref(it)
        return it

    def _device_delivery(self):
        d = self._delivery
        if d is None:
            from .device import DeviceDelivery

            d = self._delivery = DeviceDelivery(self._device, tail=self._device_tail)
        return d

    def _split_for_pass(self, split=None):
        """What coordl's pipeline prepares in a pass that builds its prep now
        (``split=None``: split the dataset's transform as it is now, so an
        assignment to ``dataset.transform`` takes effect at the next pass),
        or in one that reuses persistent workers (``split``: theirs).
        Returns the split (coordl.device.Split)."""
        from .device import delivery as _dev
        from .pipeline.collate import is_default_collate

        if split is None:
            if self._device is None:
                split = _dev.Split(self.dataset, None, "")
            elif not self._mode.runs_pipeline:
                split = _dev.Split(self.dataset, None, "not split (torch's machinery reads this dataset: no "
                                                       "raw/prep, or a user sampler): images are converted on "
                                                       "the CPU")
            elif type(self._mode) is not PipelineMode:
                split = _dev.Split(self.dataset, None, "not split (share=True: the node daemon prepares "
                                                       "samples whole): images are converted on the CPU")
            elif not is_default_collate(self.collate_fn) or self.batch_size is None:
                split = _dev.Split(self.dataset, None, "not split (a collate_fn or batch_size=None: where the "
                                                       "images land is unknown): images are converted on the CPU")
            else:
                split = _dev.split_for_device(self.dataset, self._device)
                old = self._device_tail
                if split.tail is not None and old is not None and split.tail.normalizes == old.normalizes:
                    split.tail = old    # its constants are on the device already
        self._device_tail = split.tail
        self._counters.device_split = split.note
        if self._delivery is not None:
            self._delivery.tail = split.tail
        return split

    def _stage_envelope(self, env, note: str):
        """In the pin thread: start the copy of ``env``'s batch to the device."""
        if env.batch is not None:
            try:
                env.batch = self._device_delivery().stage(env.batch, getattr(env.stats, "device_marks", ()))
            except Exception as e:
                raise RuntimeError(f"copying {note} to {self._device} failed ({type(e).__name__}: {e})") from e
        return env

    def _deliver(self, batch, marks=()):
        """Hand ``batch`` to the device (coordl.device): coordl's pipeline's
        through the pinned ring (already staged by the pin thread, or staged
        here, without workers); a batch of torch's machinery straight from
        the page-locked memory torch's pin thread put it in."""
        from .device import Staged

        d = self._device_delivery()
        if type(batch) is Staged:
            return d.hand_over(batch)
        if self._mode.runs_pipeline:
            return d.deliver(batch, marks)
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
        cache = NodeCache.attach(self.dataset.fingerprint(), len(self.dataset), self._cache_size,
                                 checksum=checksum, keep_warm=keep_warm)
        _reaper.start()
        weakref.finalize(self, _reaper.later, cache.close)  # finalizers only enqueue
        return cache

    def _get_iterator(self):
        # torch's hook for building its iterator (torch-machinery modes only)
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
        if self.batch_size is None:
            return 1
        t = _first_tensor(batch)
        if t is not None:
            # size(0), not shape[0]: a strided nested tensor has no sizes
            return int(t.size(0)) if t.dim() > 0 else 1
        try:
            return len(batch)
        except TypeError:
            return 1


def _parse_device(device) -> torch.device | None:
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

        # batches are already on the CPU (the test seam runs the device path on it)
        return dev if _dev.CPU_TEST_DEVICE else None
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
