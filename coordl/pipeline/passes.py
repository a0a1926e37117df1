"""One pass of a :class:`coordl.DataLoader` as the user's loop sees it.

``_LoaderIter`` wraps whatever a mode built for the pass (coordl's pipeline,
the daemon's shared iterator, or torch's own iterator): it counts and times
batches into the loader's statistics, unwraps envelopes, hands batches to
device delivery, draws the progress bar, records progress for
``state_dict`` (``_Pass``), and carries torch's iterator attributes.
``_PassSampler`` is the index sampler torch's machinery reads in plan order.
"""
from __future__ import annotations

import itertools
import time
import warnings
import weakref
from typing import Any

import torch
# the loader a pass belongs to is given to it (a coordl.DataLoader, typed as torch's base
# class): this module never imports the layer above it
# torch's class from its own module: a script may point torch.utils.data.DataLoader at coordl's
from torch.utils.data.dataloader import DataLoader as _TorchDataLoader
from torch.utils.data.dataloader import _DatasetKind

from ..device import pin as _pin
from ..errors import SkippedSampleWarning
from ..plan import lane_again
from .torch_path import Envelope, Task

__all__ = ["_Pass", "_PassSampler", "_LoaderIter", "_first_tensor"]

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
        self.order = None  # the pass's IndexOrder when a user sampler gives the order on coordl's pipeline
        self.order_restore = None  # the order a loaded state recorded for the pass about to start
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

    def __init__(self, loader: _TorchDataLoader) -> None:
        # weak: a loader <-> sampler cycle would keep a dead loader's worker
        # iterator alive until a gc run, possibly inside a forked worker.
        self._loader_ref = weakref.ref(loader)

    def __len__(self) -> int:
        L = self._loader_ref()
        if L._plan is not None:
            return L._plan.num_batches
        return len(L._sampler_now())

    def __iter__(self):
        # The generators below must not hold the loader: with persistent
        # workers torch keeps them in the loader's iterator (a cycle).
        L = self._loader_ref()
        p = L._pass
        epoch, start, skip = p.epoch, p.start, p.skip
        tag = L._mode.tag_tasks
        if L._plan is not None:
            it = L._plan.batches(epoch, start)
            if tag:
                it = ((x, None) for x in it)     # a rank's plan never repeats an index
        else:
            it = _torch_steps(
                L._sampler_now(), L._rng_generators(), p,
                start if L._dataset_kind != _DatasetKind.Iterable else 0, counted=tag,
                lane=sampler_lane(L) if tag else (0, 1),
            )
        if skip:
            it = _without(it, start, skip)
        return _tag(epoch, it) if tag else it


def sampler_lane(loader) -> tuple[int, int]:
    """``(rank, replicas)`` the loader's sampler draws its order for: the
    sampler's own ``rank`` and ``num_replicas`` where it has them (torch's
    ``DistributedSampler``, torchvision's ``RASampler``, timm's
    ``RepeatAugSampler``; also inside a ``BatchSampler``), else the
    loader's rank and world size (``torch.distributed``).  The same index
    on two ranks then draws two augmentations (``coordl.plan.IndexOrder.set_lane``)."""
    s = loader._sampler_now()
    for obj in (s, getattr(s, "sampler", None)):
        rank, n = getattr(obj, "rank", None), getattr(obj, "num_replicas", None)
        if type(rank) is int and type(n) is int and 0 <= rank < n:
            return rank, n
    return loader._rank, loader._world_size


def _without(steps, start: int, skip: frozenset):
    for k, x in enumerate(steps, start):
        if k not in skip:
            yield x


def _tag(epoch: int, steps):
    for x, again in steps:
        yield Task(epoch, x, again)


def _counted(steps, lane: tuple = (0, 1)):
    """``(step, again)`` for each step (an index, or a list of them):
    ``again`` how many times each index came before in the pass (an int, or
    a list), None while no index has repeated; for ``lane`` = (rank,
    replicas) of a sampler that may give several ranks the same index,
    made each rank's own (``coordl.plan.lane_again``)."""
    rank, replicas = lane
    seen: dict = {}
    repeated = bool(rank)
    for x in steps:
        if isinstance(x, (list, tuple)):
            again = []
            for i in x:
                n = seen.get(i, 0)
                again.append(lane_again(n, rank, replicas))
                seen[i] = n + 1
            repeated = repeated or any(again)
        else:
            n = seen.get(x, 0)
            again = lane_again(n, rank, replicas)
            seen[x] = n + 1
            repeated = repeated or bool(again)
        yield x, (again if repeated else None)


def _torch_steps(index_sampler, gens: list, p: _Pass, start: int, counted: bool = False, lane: tuple = (0, 1)):
    """torch's own index sampler for this pass, skipping ``start`` steps;
    with ``counted``, :func:`_counted`'s pairs (the skipped steps counted;
    ``lane``: its rank and replicas).

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
    if counted:
        steps = _counted(steps, lane)
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

    def __init__(self, loader: _TorchDataLoader, inner, epoch: int, fast_forward: int,
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
        # the iterator of a newer pass over the same persistent workers (DataLoader.__iter__): this one then
        # is that one, as torch's iter() returns its one iterator reset
        self._successor: _LoaderIter | None = None

    def __iter__(self) -> "_LoaderIter":
        return self

    def __len__(self) -> int:
        if self._successor is not None:
            return len(self._successor)
        return len(self._inner)

    def __next__(self) -> Any:
        if self._successor is not None:
            return next(self._successor)
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
                    after = getattr(data.stats, "device_after", None)
                else:
                    self._delivered(None)
                    batch, n, marks, after = data, L._count_samples(data), (), None
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
            batch = L._deliver(batch, marks, after)
            if type(data) is Envelope and data.stats.device_samples is not None:
                batch = L._collate_delivered(batch, data)   # decode="device" with a collate_fn
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
        if self._successor is not None:
            return self._successor._shutdown_workers()
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
