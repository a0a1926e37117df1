"""How a loader runs its passes: one small strategy object per mode, chosen
in one place (:func:`choose_mode`), as torch picks its iterator class in
``DataLoader._get_iterator``.

=====================  ==========================================  ==========================
mode                   chosen when                                 runs a pass with
=====================  ==========================================  ==========================
``PipelineMode``       two-stage dataset, order from the epoch     coordl's pipeline
                       plan, or from a user sampler/batch sampler  (``workers.py``)
                       with a length (read once per pass)
``TwoStageTorchMode``  two-stage dataset with a sampler without    torch's iterators over
                       a length, or any map-style dataset with     ``TwoStageFetch``
                       ``on_error="skip"``
``TensorBatchMode``    an unmodified ``TensorDataset``, default    torch's iterators over
                       collation, no user sampler                  ``TensorBatchFetch``
``TorchMode``          anything else                               torch's iterators, the
                                                                   user's dataset untouched
=====================  ==========================================  ==========================

Each mode says what it holds across passes and who stops it (its shutdown
invariants, in its docstring); the loader only calls ``start_pass``,
``build_torch_iterator`` (torch's hook), ``adopt_seed`` and ``exact_steps``.
"""
from __future__ import annotations

import os
import warnings

import torch
# torch's class from its own module: a script may point torch.utils.data.DataLoader at coordl's
from torch.utils.data.dataloader import DataLoader as _TorchDataLoader
from torch.utils.data import TensorDataset

from ..device import pin as _pin
from .collate import is_default_collate
from .torch_path import CollateEnvelope, TensorBatchFetch, TwoStageFetch, passthrough_collate

__all__ = ["choose_mode", "sampler_order", "PipelineMode", "TwoStageTorchMode", "TensorBatchMode", "TorchMode"]


class TorchMode:
    """torch's own iterators over the user's dataset, untouched.

    Holds nothing across passes.  torch's iterator owns its worker processes:
    a non-persistent iterator shuts them down when it ends or is collected;
    with ``persistent_workers`` torch keeps the iterator in
    ``loader._iterator`` until the loader is collected or ``adopt_seed``
    drops it.
    """

    name = "torch"
    runs_pipeline = False
    tag_tasks = False          # _PassSampler wraps steps in Task(epoch, ...)

    def exact_steps(self, loader) -> bool:
        """Whether each delivered batch's step is known (torch's workers with
        ``in_order=False`` hand batches over without it)."""
        return loader.in_order or loader.num_workers == 0

    def start_pass(self, loader, epoch: int, start: int, skip: frozenset):
        return _TorchDataLoader.__iter__(loader)

    def build_torch_iterator(self, loader):
        return _TorchDataLoader._get_iterator(loader)

    def adopt_seed(self, loader, seed: int) -> None:
        if loader._iterator is not None:  # persistent workers hold the old seed
            loader._iterator._shutdown_workers()
            loader._iterator = None


class _WrappedTorchMode(TorchMode):
    """torch's iterators over a coordl dataset wrapper and collate function,
    swapped into the loader only while torch builds its iterator (torch reads
    ``loader.dataset``/``collate_fn`` once then, and ships them to workers),
    so the user's objects are never modified.  Shutdown as ``TorchMode``."""

    fetch_dataset = None
    fetch_collate = None

    def build_torch_iterator(self, loader):
        d = loader.__dict__
        saved = d["dataset"], d["collate_fn"]
        d["dataset"], d["collate_fn"] = self.fetch_dataset, self.fetch_collate
        try:
            return _TorchDataLoader._get_iterator(loader)
        finally:
            d["dataset"], d["collate_fn"] = saved


class TwoStageTorchMode(_WrappedTorchMode):
    """raw -> prep per sample (``TwoStageFetch``) under torch's machinery:
    a two-stage dataset whose order comes from a sampler without a length, or a generic
    map-style dataset with ``on_error="skip"`` (``dataset[i]`` per sample, so
    one bad sample can be dropped)."""

    name = "two-stage-torch"

    def __init__(self, dataset, seed: int | None, on_error: str, collate_fn, two_stage: bool) -> None:
        self._dataset, self._on_error = dataset, on_error
        self.tag_tasks = two_stage  # the epoch keys per-sample augmentation
        self.fetch_dataset = TwoStageFetch(dataset, seed if seed is not None else 0, on_error)
        self.fetch_collate = CollateEnvelope(collate_fn)

    def adopt_seed(self, loader, seed: int) -> None:
        self.fetch_dataset = TwoStageFetch(self._dataset, seed, self._on_error)
        super().adopt_seed(loader, seed)


class TensorBatchMode(_WrappedTorchMode):
    """An unmodified ``TensorDataset`` with default collation: one
    ``index_select`` per tensor per batch instead of N ``__getitem__`` calls
    and a stack (identical tensors)."""

    name = "tensor-batch"

    def __init__(self, dataset: TensorDataset) -> None:
        self.fetch_dataset = TensorBatchFetch(dataset.tensors)
        self.fetch_collate = passthrough_collate


class PipelineMode:
    """coordl's own pipeline for a two-stage dataset, in plan order or, with
    ``from_sampler``, in the order the user's sampler (or batch sampler)
    yields for the pass: read once in the main process when the pass
    starts (as torch's iterator reads it, after the same draw of its base
    seed), so the same torch seed gives the same indices as torch's
    DataLoader (:meth:`sampler_order`).

    Holds across passes: with ``persistent_workers`` the ``WorkerPool``
    (stopped by ``adopt_seed`` or when the loader is collected, through the
    pool's own finalizer); without, each pass's ``PipelineIter`` owns its
    pool and stops it when the pass ends, fails or is collected.  With
    pinning and workers, the last pass's pin thread, which is the only thread
    driving the pool while it runs: ``start_pass`` stops it before a new pass
    touches the pool.  ``num_workers=0`` holds nothing (each pass's
    ``InlineIter`` owns its fetch threads).
    """

    name = "pipeline"
    runs_pipeline = True
    tag_tasks = True

    def __init__(self, from_sampler: bool = False) -> None:
        self.from_sampler = from_sampler
        self.pool = None
        self.pool_split = None  # the device split the persistent pool prepares (coordl.device)
        self._pin_prev = None  # [(stop event, queue, thread)] of the last pass's pin (and decode) threads
        self._stash = None     # slots kept between the pools of passes (workers not persistent)

    def exact_steps(self, loader) -> bool:
        return True  # every envelope carries its step

    def build_torch_iterator(self, loader):  # pragma: no cover - never asked
        raise AssertionError("coordl's pipeline does not use torch's iterators")

    def start_pass(self, loader, epoch: int, start: int, skip: frozenset):
        self._stop_pin_thread()  # before the new pass touches the pool
        return self._pin(loader, self._pipeline_iter(loader, epoch, start, skip))

    def adopt_seed(self, loader, seed: int) -> None:
        self._stop_pin_thread()
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def _stop_pin_thread(self) -> None:
        """One thread drives a pool: the last pass's pin thread (it may still
        be waiting in the pool for a batch of its abandoned pass) must be gone
        before the next pass begins, or it could take that pass's batches."""
        prev, self._pin_prev = self._pin_prev, None
        _pin.stop_threads(prev or [])

    def _pin(self, loader, inner):
        """Pin the pipeline's batches when asked (torch's machinery pins in
        its own thread): with workers in a pin thread, else inline."""
        if loader._device is not None:
            if loader.num_workers == 0:
                if loader._decode == "device":   # decoded before the loop counts the batch
                    return _pin.StageInline(inner, loader._stage_envelope)
                return inner     # staged and handed over in next() (DataLoader._deliver)
            if loader._decode == "device":
                # the device decode of the next batch (the decoder waits for
                # the GPU, without the GIL) overlaps the geometry and copy of
                # this one: a decode thread one batch ahead of the pin thread;
                # and the workers' batches are taken in (their messages, their
                # slots) and made ready for the decoder (the streams, the rows
                # the workers prepared gathered) by a thread of their own one
                # batch ahead of it, so that the decode thread, which bounds
                # delivery on a GPU, only decodes (about 5 us per image of
                # Python that ran between its calls, 7% of its time at 13,000
                # images/s; and with the workers' share their rows' copy)
                fetching = _pin.PinThread(inner, depth=1, stage=loader._prepare_envelope, name="coordl-device-fetch")
                decoding = _pin.PinThread(fetching, depth=1, stage=loader._decode_envelope,
                                          name="coordl-device-decode")
                pinner = _pin.PinThread(decoding, depth=loader.prefetch_factor or 2, stage=loader._stage_envelope)
                self._pin_prev = [pinner.halting, decoding.halting, fetching.halting]
                return pinner
            # the copy to the device starts one batch ahead, in the pin thread
            pinner = _pin.PinThread(inner, depth=loader.prefetch_factor or 2, stage=loader._stage_envelope)
            self._pin_prev = [pinner.halting]
            return pinner
        if not loader.pin_memory:
            return inner
        if not _pin.accelerator_available():
            # torch's wording, so filters written for torch's loader match
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "so coordl delivers batches in pageable memory.", stacklevel=4)
            return inner
        if loader.num_workers == 0:
            return _pin.PinInline(inner)
        pinner = _pin.PinThread(inner, depth=loader.prefetch_factor or 2)
        self._pin_prev = [pinner.halting]
        return pinner

    def _pipeline_iter(self, loader, epoch: int, start: int, skip: frozenset):
        from .workers import InlineIter, PipelineIter, WorkerPool

        W = loader.num_workers
        cfg = dict(
            seed=loader.seed, on_error=loader.on_error, collate_fn=loader.collate_fn,
            # None: no batching; 0: batches of a batch sampler, of any size
            batch_size=loader.batch_size if loader.batch_size is not None or not loader._auto_collation else 0,
            prefetch=loader.prefetch_factor or 2,
            fetch_threads=loader._fetch_threads,
            budget=max(1 << 20, loader._read_ahead // max(1, W)),
            worker_init_fn=loader.worker_init_fn, cache=loader._cache, peers=loader._peers,
            # decode="device": the user's collate_fn runs on the device's batch (DataLoader._collate_delivered)
            collate_later=loader._decode == "device" and not is_default_collate(loader.collate_fn),
        )
        loader._collate_later = cfg["collate_later"]
        if loader._peers is not None:
            loader._peers.start(epoch)   # the run's first epoch: who read what (before workers copy it)
        if W == 0:
            ds = loader._split_for_pass().dataset   # the transform as it is now (coordl.device)
            if self.from_sampler:   # torch's iterator draws its base seed before the sampler's first draw
                torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
            return InlineIter(ds, cfg, self._order(loader), epoch, start, skip=skip)
        pool = self.pool
        if pool is not None and not pool.closed:
            loader._split_for_pass(self.pool_split)  # persistent workers prepare as when they started
        else:
            split = self._new_split(loader)
            cfg["base_seed"] = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
            ctx = loader.multiprocessing_context
            if ctx is None:
                import multiprocessing
                ctx = multiprocessing.get_context()
            if self._stash is None and not loader.persistent_workers and _keep_slots():
                from .slots import SlotStash
                self._stash = SlotStash()
            pool = WorkerPool(split.dataset, cfg, W, ctx, timeout=loader.timeout,
                              stash=None if loader.persistent_workers else self._stash)
            if loader.persistent_workers:
                self.pool, self.pool_split = pool, split
        try:
            order = self._order(loader)
        except BaseException:
            if not loader.persistent_workers:
                pool.shutdown()
            raise
        return PipelineIter(pool, order, epoch, start, loader.in_order,
                            owns_pool=not loader.persistent_workers, skip=skip)

    def _new_split(self, loader):
        """What a pass that starts its workers prepares: the dataset as it is now."""
        return loader._split_for_pass()

    def _order(self, loader):
        """This pass's order: the epoch plan, or the sampler's (:meth:`sampler_order`)."""
        if not self.from_sampler:
            return loader.plan
        return sampler_order(loader)


def _keep_slots() -> bool:
    """``COORDL_KEEP_SLOTS`` (default on): a loader without persistent
    workers keeps its last pass's free batch slots for the next pass
    (``pipeline.slots.SlotStash``); off, they are freed when the pass ends."""
    return os.environ.get("COORDL_KEEP_SLOTS", "1").strip().lower() not in ("0", "false", "no", "off")


def sampler_order(loader):
    """The steps the loader's index sampler (its ``batch_sampler``, or its
    ``sampler`` in batches of ``batch_size``) yields for the pass now
    starting, as an :class:`coordl.plan.IndexOrder`, iterated once here as
    torch's iterator iterates it.  The RNG states it draws from are
    recorded for the loader's state (``_Pass.rng``; on resume they are set
    back first, see ``passes._torch_steps``).  On resume the state's own
    record of the epoch's order is what the pass runs: when the sampler
    now yields another order (randomness coordl does not save, e.g.
    Python's ``random``), a warning says so."""
    from ..plan import IndexOrder
    from .passes import _torch_steps, sampler_lane

    p = loader._pass
    lane = sampler_lane(loader)
    steps = _torch_steps(loader._sampler_now(), loader._rng_generators(), p, 0)
    order = IndexOrder.from_steps(steps, loader._auto_collation, len(loader.dataset))
    saved, p.order_restore = p.order_restore, None
    if saved is not None and not order.same_as(saved):
        warnings.warn(
            f"coordl: the sampler yields another order for epoch {p.epoch} than the one the loaded state "
            "recorded (its randomness does not come from the torch generators a state saves: the loader's "
            "generator, the sampler's, torch's global one); the rest of this epoch follows the recorded "
            "order, exactly, and later epochs the sampler's", stacklevel=5)
        order = saved
    order.set_lane(*lane)
    p.order = order
    return order


def choose_mode(dataset, *, two_stage: bool, plan_order: bool, user_sampler: bool, iterable: bool,
                on_error: str, seed: int | None, collate_fn, user_collate: bool,
                batch_size: int | None, sized_sampler: bool = False):
    """The one place a loader's mode is picked (see the table above)."""
    if two_stage and plan_order:
        return PipelineMode()
    if two_stage and user_sampler and sized_sampler:
        return PipelineMode(from_sampler=True)
    if two_stage or (on_error == "skip" and not iterable):
        return TwoStageTorchMode(dataset, seed, on_error, collate_fn, two_stage)
    if (type(dataset) is TensorDataset and not user_collate and batch_size is not None
            and not user_sampler and not any(t.requires_grad for t in dataset.tensors)):
        return TensorBatchMode(dataset)
    return TorchMode()
