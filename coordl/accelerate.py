"""coordl's DataLoader under Hugging Face Accelerate.

``accelerator.prepare(loader)`` does not keep the loader it is given: it
builds a torch ``DataLoader`` of its own from the loader's dataset and
arguments (with its batch sampler cut into one share per process) and
wraps that.  A ``coordl.DataLoader`` handed to it would therefore load
through torch's workers, without coordl's pipeline (node cache, prefetch
onto the GPU, shared prep, exact resume, statistics), and nothing would
say so.  :func:`prepare` is ``accelerator.prepare`` with
that one thing changed: the loader Accelerate wraps is a coordl loader
built with the user's arguments and Accelerate's batch sampler, so
Accelerate keeps everything it does (the shares per process, even batches,
device placement, the gradient state's end of the loader, synchronized
sampler generators) and coordl does the loading::

    import coordl.accelerate

    loader = coordl.DataLoader(dataset, batch_size=64, shuffle=True, num_workers=8)
    model, optimizer, loader = coordl.accelerate.prepare(accelerator, model, optimizer, loader)

:func:`skip_first_batches` is ``accelerator.skip_first_batches`` kept on
coordl the same way.  Accelerate is imported only by the caller: this
module needs nothing from it but the objects it is given.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["prepare", "skip_first_batches"]


def prepare(accelerator: Any, *args: Any, device_placement: list | None = None) -> Any:
    """``accelerator.prepare(*args)``, every ``coordl.DataLoader`` among
    ``args`` still loading through coordl.

    Returns what ``accelerator.prepare`` returns (one object, or a tuple in
    the order given); each prepared loader is Accelerate's own wrapper
    around a coordl loader (``isinstance(prepared, coordl.DataLoader)``
    holds, as Accelerate makes it hold for torch's class;
    ``prepared.stats()`` is coordl's).  With one process Accelerate leaves
    the batches as they are, and the loader given is the one wrapped; with
    several, the wrapped loader is built with the given one's arguments and
    Accelerate's share of its batch sampler.
    """
    from .loader import DataLoader

    kwargs = {} if device_placement is None else {"device_placement": device_placement}
    result = accelerator.prepare(*args, **kwargs)
    prepared = list(result) if len(args) > 1 else [result]
    for k, given in enumerate(args):
        if isinstance(given, DataLoader) and not getattr(given, "_is_accelerate_prepared", False):
            _keep_coordl(prepared[k], lambda base, given=given: _coordl_like(given, base), "prepare")
    return tuple(prepared) if len(args) > 1 else prepared[0]


def skip_first_batches(accelerator: Any, dataloader: Any, num_batches: int = 0) -> Any:
    """``accelerator.skip_first_batches(dataloader, num_batches)`` for a
    loader :func:`prepare` gave, its batches still prepared by coordl.

    The loader returned starts its next pass at batch ``num_batches`` of
    the epoch the given one would run next, in coordl's order (its epoch
    plan's, or its sampler's), without preparing the batches before it;
    its ``len()`` is the whole epoch's, as for a loader resumed from a
    state.
    Not needed to resume a coordl loader: ``load_state_dict`` of a state
    saved mid-epoch already starts at the first batch not delivered, so
    a loader holding such a state raises here rather than skip twice.  This
    is for scripts that resume by counting batches, as Accelerate's
    examples do.
    """
    from .loader import DataLoader

    template = vars(_wrapped(dataloader)).get("base_dataloader")
    if not isinstance(template, DataLoader):
        raise TypeError(
            "coordl.accelerate.skip_first_batches() takes a loader that coordl.accelerate.prepare() returned, "
            f"but got {type(dataloader).__name__}: use accelerator.skip_first_batches() for other loaders")
    state = template.state_dict()
    if state["batches"] or state["done"]:
        raise ValueError(
            f"this loader already resumes at batch {state['batches']} of epoch {state['epoch']} from the state "
            f"loaded into it: skipping {num_batches} batches more would skip them twice; iterate it as it is")
    result = accelerator.skip_first_batches(dataloader, num_batches)
    # Accelerate skips an IterableDataset's batches itself, in its wrapper, as they come
    skip = 0 if vars(_wrapped(result)).get("skip_batches") else num_batches
    _keep_coordl(result, lambda base: _at_batch(template, state, skip), "skip_first_batches")
    return result


def _wrapped(prepared: Any) -> Any:
    """The object of Accelerate's that holds the loader it iterates
    (``base_dataloader``): the prepared loader itself, or, on XLA, the
    loader inside its device-loader wrapper."""
    if "base_dataloader" not in vars(prepared) and "_loader" in vars(prepared):
        return vars(prepared)["_loader"]
    return prepared


def _keep_coordl(prepared: Any, make: Callable[[Any], Any], call: str) -> None:
    """Put a coordl loader (``make(base)``) where Accelerate's ``prepared``
    holds the torch loader ``base`` it built."""
    from .loader import DataLoader

    holder = _wrapped(prepared)
    base = vars(holder).get("base_dataloader")
    if base is None:
        raise TypeError(
            f"accelerator.{call}() returned {type(prepared).__name__}, which holds no loader coordl can keep "
            "its pipeline in (Accelerate 0.34 or later wraps one as `base_dataloader`): upgrade accelerate, or "
            "give coordl.DataLoader rank=accelerator.process_index and "
            "world_size=accelerator.num_processes and iterate it without accelerator.prepare()")
    if isinstance(base, DataLoader):
        return
    holder.base_dataloader = loader = make(base)
    # what Accelerate's state_dict() answers before the first batch (it takes the loader's after each one):
    # coordl's, not that of the torchdata loader Accelerate may have built
    holder.dl_state_dict = loader.state_dict()
    # Accelerate's wrapper counts epochs itself (set_epoch, and its own count at each pass): coordl's loader
    # follows it, and a state loaded into the loader sets that count to the state's epoch
    if callable(getattr(type(holder), "set_epoch", None)):
        holder.set_epoch = _SetEpoch(holder, loader)
    holder.load_state_dict = _LoadState(holder, loader)
    if loader.plan is not None and loader.plan.batch_size is not None:
        # coordl's epoch plan decides the order, not the sampler torch's machinery made: what Accelerate reads
        # as the batch sampler (its skip_first_batches, the sampler of its shares) is the plan's batches
        holder.batch_sampler = _PlanBatches(loader)


def _coordl_like(given: Any, base: Any) -> Any:
    """A coordl loader that delivers what Accelerate's torch loader ``base``
    (built from ``given``) would: the given loader itself where Accelerate
    changed nothing, else one built with the given loader's arguments and
    ``base``'s dataset and batching."""
    if base.batch_size is None:     # torch's loader was given a batch sampler
        same = base.batch_sampler is given.batch_sampler
    else:
        same = (base.sampler is given.sampler and base.batch_size == given.batch_size
                and base.drop_last == given.drop_last)
    if same and base.dataset is given.dataset:
        return given
    args = dict(given._built_with)
    if base.dataset is not given.dataset:
        args["dataset"] = base.dataset      # Accelerate's share of an IterableDataset, around coordl's own
    if base.batch_size is None:             # Accelerate's share of the batches
        args.update(batch_sampler=base.batch_sampler, batch_size=1, sampler=None, shuffle=None, drop_last=False)
    else:                                   # a sampler that yields batches, or an IterableDataset
        iterable = isinstance(base.dataset, torch.utils.data.IterableDataset)
        args.update(batch_sampler=None, batch_size=base.batch_size, drop_last=base.drop_last, shuffle=None,
                    sampler=None if iterable else base.sampler)
    args["generator"] = base.generator
    return type(given)(**args)


def _at_batch(template: Any, state: dict, batches: int) -> Any:
    """A copy of the coordl loader ``template`` (its arguments, seed, rank
    and world size, as pickling copies it) whose next pass starts at step
    ``batches`` of the epoch ``state`` (the template's, at a pass's start)
    says comes next."""
    from .loader import _built_again

    args = dict(template._built_with, seed=template._seed, rank=template._rank, world_size=template._world_size)
    return _built_again(type(template), args, dict(state, batches=batches))


class _SetEpoch:
    """Accelerate's ``set_epoch`` of its wrapper, then coordl's loader's (a
    class, not a closure, so that the wrapper still pickles)."""

    def __init__(self, holder: Any, loader: Any) -> None:
        self.holder, self.loader = holder, loader

    def __call__(self, epoch: int) -> None:
        type(self.holder).set_epoch(self.holder, epoch)
        self.loader.set_epoch(epoch)


class _LoadState:
    """coordl's ``load_state_dict``, then the wrapper's count of epochs set
    to the state's, so that the wrapper's next pass (which sets that epoch)
    is the one the state resumes."""

    def __init__(self, holder: Any, loader: Any) -> None:
        self.holder, self.loader = holder, loader

    def __call__(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        if hasattr(self.holder, "iteration"):
            self.holder.iteration = self.loader.epoch


class _PlanBatches:
    """The batches of a coordl loader's epoch plan for the epoch it runs
    next, as a batch sampler: what tools that re-read a loader's batch
    sampler (Accelerate's ``skip_first_batches``) then find is the order
    coordl delivers.  ``set_epoch`` is the loader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.batch_size, self.drop_last = loader.plan.batch_size, loader.plan.drop_last

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self):
        return iter(self.loader.plan.batches(self.loader.epoch))

    def __len__(self) -> int:
        return self.loader.plan.num_batches
