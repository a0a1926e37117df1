"""``coordl analyze``: is training waiting for data, and what would help?

The differential method of CoorDL's DS-Analyzer, run on a real
``coordl.DataLoader``:

1. **fetch-only, cold**: the fetch stage alone (prep replaced by
   ``len(raw)``) after evicting the dataset from the page cache: storage
   bandwidth ``S_bw`` (when the node cache is used, this pass fills it);
2. **fetch-only, warm**: the same again, now from memory: cache bandwidth
   ``C_bw``;
3. **prep-only**: loader without a step, data in memory, at 1 and 2 workers
   (and the requested count): prep rates ``P(w)``;
4. **ingestion-free**: the model step alone on a batch already in memory
   (or the target rate given): ``G``;
5. **cached**: loader + step, data in memory: ``R_c``;
6. **cold**: loader + step after evicting again: ``R_f``.

From them: fetch and prep stall (``coordl.analyze.model.stalls``) and
what-if tables (``coordl.analyze.model``).  See docs/guide/analyze.md.

Modules: ``sources`` (what the passes read), ``measure`` (timed passes,
eviction, counters), ``inputs`` (the model's inputs and its own error from
the passes), ``model`` (the what-if arithmetic), ``report``, ``cli``.

    from coordl.analyze import analyze, format_report
    report = analyze(root="/data/train", transform="rrc224", batch_size=64, workers=4, rate=2000)
    print(format_report(report))
"""
from __future__ import annotations

import os
import statistics
import time
import warnings
from typing import Any, Callable, Sequence

from . import model
from .inputs import MODEL_ERROR_CAP, MODEL_ERROR_FLOOR, _model_error, _model_inputs  # noqa: F401 (public here)
from .model import MODEL_ERROR_VERDICT  # noqa: F401 (public here)
from .measure import TRANSFORMS
from .report import format_report, recommend, step_words, write_json, write_plot

__all__ = ["analyze", "measure_prep", "format_report", "write_json", "write_plot", "model", "TRANSFORMS",
           "predict", "recommend", "STEP_KINDS", "MODEL_ERROR_FLOOR", "MODEL_ERROR_CAP", "MODEL_ERROR_VERDICT"]

_MiB = 2 ** 20


def _check_pos_int(v, name):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} should be a positive int, but got {name}={v!r}")
    return v


STEP_KINDS = ("auto", "cpu", "accelerator")


def analyze(root: str | os.PathLike | None = None, *, dataset: Any = None, transform: Any = "rrc224",
            batch_size: int = 32, workers: int = 2, step: Callable | str | None = None,
            rate: float | None = None, max_samples: int | None = None, cache: str = "auto",
            evict: str = "auto", scaling_workers: Sequence[int] = (1, 2, 3), max_workers: int | None = None,
            fetch_threads: int | None = None, ingest_seconds: float = 3.0, repeats: int = 3,
            step_kind: str = "auto", device: Any = None, model_error: float | None = None,
            log: Callable[[str], None] | None = print) -> dict:
    """Run the measurement, fit the model and return the report (a dict, JSON-ready).

    Args:
        root: an ImageFolder directory (``coordl.ImageFolder(root, transform)``).
        dataset: instead of ``root``: a two-stage dataset object, or
            ``"module:callable"`` / ``"file.py:callable"`` returning one
            (called without arguments; ``transform`` is then not used).
        transform: for ``root``: a name in ``TRANSFORMS``, a
            ``"module:callable"`` returning a transform, or a transform.
        batch_size, workers: the loader's, as in training.
        step: the model step, ``step(batch)``: a callable or
            ``"module:fn"`` / ``"file.py:fn"``.  Exactly one of ``step`` and
            ``rate`` must be given.
        rate: a target ingestion rate (samples/s) instead of a step: the
            step then sleeps ``batch/rate`` seconds (an accelerator that
            needs no host CPU).
        max_samples: measure on this many samples spread over the dataset
            (default: all of it).
        cache: where the "in memory" passes read from: ``"node"``,
            ``"page"`` or ``"auto"`` (node when the dataset has a
            fingerprint and fits in a quarter of available memory).
        evict: how cold passes start cold: ``"auto"`` (drop_caches as root,
            else fadvise), ``"drop_caches"``, ``"fadvise"``.
        scaling_workers: worker counts whose prep rate and CPU cost are
            measured (besides ``workers``); three or more let the fit say
            whether more workers help.
        max_workers: the workers what-if goes up to this (default: twice
            the CPUs this process may use, at least ``workers``).
        fetch_threads: passed to the loader.
        ingest_seconds: how long the step alone runs (in 3 chunks).
        repeats: run each in-memory pass (fetch warm, prep, cached) this
            many times; the median is the value, the spread the interval.
        step_kind: ``"auto"`` (decide from the step's CPU-seconds per
            wall-second alone: >= 0.5 is a CPU step), ``"cpu"`` or
            ``"accelerator"``.  Reported; the model charges the step's
            measured CPU to the shared cores either way.
        device: passed to the loader (``DataLoader(device=...)``), so the
            passes run the device path training runs.
        model_error: the model's own relative error, by which every
            prediction's interval is widened beyond its inputs' spread
            (``lo / (1 + e)``, ``hi / (1 - e)``).  ``None``: the larger of
            ``MODEL_ERROR_FLOOR`` and the model's error on the
            analyzer's own loader + step passes (cold and cached), which
            no input is fitted to.  When that error is past
            ``MODEL_ERROR_VERDICT`` (a pass disturbed by other work on the
            machine), everything is measured once more and the report is
            the look with the smaller error; ``report["looks"]`` lists each
            look's error and verdict.
        log: progress messages go here (``None``: silent).
    """
    from . import measure as M

    say = log or (lambda _msg: None)
    _check_pos_int(batch_size, "batch_size")
    _check_pos_int(repeats, "repeats")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers should be an int >= 0, but got workers={workers!r}")
    if (step is None) == (rate is None):
        raise ValueError(f"give exactly one of step (the model's training step) and rate (a target ingestion "
                         f"rate in samples/s), but got step={step!r}, rate={rate!r}")
    if rate is not None:
        rate = model._positive(rate, "rate")
    if cache not in ("auto", "node", "page"):
        raise ValueError(f'cache should be "auto", "node" or "page", but got cache={cache!r}')
    if evict not in ("auto", "drop_caches", "fadvise"):
        raise ValueError(f'evict should be "auto", "drop_caches" or "fadvise", but got evict={evict!r}')
    if model_error is not None and (isinstance(model_error, bool) or not isinstance(model_error, (int, float))
                                    or not 0 <= model_error < 0.9):
        raise ValueError(f"model_error should be a number in [0, 0.9) (a relative error, e.g. 0.1) or None, but "
                         f"got model_error={model_error!r}")
    if step_kind not in STEP_KINDS:
        raise ValueError(f'step_kind should be "auto", "cpu" or "accelerator", but got step_kind={step_kind!r}')
    scaling = sorted({_check_pos_int(w, "scaling_workers[i]") for w in scaling_workers} | ({workers} - {0}))

    step_fn = None  # resolved first: a wrong "module:fn" is said before any dataset is read
    if step is not None:
        step_fn = M.load_callable(step, "step") if isinstance(step, str) else step
        if not callable(step_fn):
            raise ValueError(f"step should be a callable or \"module:fn\", but got step={step!r}")
    elif rate is not None:
        step_fn = M.RateStep(rate)

    ds, source, tf_desc = _open_dataset(root, dataset, transform, max_samples)
    n = len(ds)
    dbytes, bytes_source = _dataset_bytes(ds)
    files = M.dataset_files(ds)
    disk = M.DeviceCounter(files[0] if files else None)
    cache, cache_size = _choose_cache(cache, ds, dbytes)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if max_workers is None:
        max_workers = max(2 * cpus, workers, max(scaling))
    _check_pos_int(max_workers, "max_workers")
    loader = _loader_factory(batch_size, fetch_threads, device)

    def look() -> dict:
        """One measurement of every pass, the model fitted to it, the report."""
        say(f"coordl analyze: {n} samples, {dbytes / _MiB:.1f} MiB ({source}), batch {batch_size}, "
            f"{workers} workers, {cpus} CPUs, in-memory passes from the {cache} cache, {repeats} repeats")
        passes: dict[str, dict] = {}
        t_all = time.perf_counter()

        # 1-2: fetch only, cold then warm (same loader: with the node cache the first pass fills it)
        eviction = M.evict(files, evict)
        F = loader(M.FetchOnly(ds), workers, cache_size)
        passes["fetch_cold"] = M.run_pass(F, device=disk)
        say(f"  fetch only, cold ({eviction}): {passes['fetch_cold']['rate']:.1f} samples/s")
        passes["fetch_warm"] = _typical(M, F, None, repeats)
        say(f"  fetch only, warm: {passes['fetch_warm']['rate']:.1f} samples/s")
        # 3: prep only at each worker count (F keeps the node cache alive)
        prep, prep_passes, batch = _prep_passes(loader, ds, scaling + ([0] if workers == 0 else []), cache_size,
                                                repeats, say, keep_batch=True)
        passes.update(prep_passes)
        # 4: the step alone, device synchronized when CUDA is in use
        if step is not None:
            ing = M.ingest_rate(step_fn, batch, seconds=ingest_seconds)
            passes["ingest"] = ing
            G = model.est_from_samples(ing["rates"], "measured: the step alone on one batch in memory"
                                       + (", device synchronized" if ing["synchronized"] else ""))
            c_step = model.est_from_samples(ing["cpu_per_sample_runs"], "measured: process CPU during the step alone")
            share = ing["cpu_share"]
            k_step = model.est_from_samples(ing.get("cpu_share_runs") or [share],
                                            "measured: cores the step kept busy alone (CPU-seconds per second it was "
                                            "not waiting for a core)")
            k_step = model.Est(share, min(k_step.lo, share), max(k_step.hi, share), k_step.source)
        else:
            G = model.Est.exact(rate, "given (rate=)")
            c_step = model.Est.exact(0.0, "given: a rate= step sleeps (no CPU)")
            share = 0.0
            k_step = model.Est.exact(0.0, "given: a rate= step sleeps (no CPU)")
        kind = step_kind if step_kind != "auto" else ("cpu" if share >= 0.5 else "accelerator")
        say(f"  step alone: {G.value:.1f} samples/s, {c_step.value * 1e3:.3f} CPU-ms/sample "
            f"({share:.2f} cores busy: {step_words(kind)})")
        del batch
        timed_step = step_fn
        sync = M.cuda_sync()
        if sync is not None and step is not None:
            timed_step = M.SyncStep(step_fn, sync)
        # 5: cached
        L = loader(ds, workers, cache_size)
        passes["cached"] = _typical(M, L, timed_step, repeats)
        say(f"  loader + step, cached: {passes['cached']['rate']:.1f} samples/s")
        del L, F
        M.collect()
        # 6: cold
        eviction2 = M.evict(files, evict)
        L = loader(ds, workers, 0)
        passes["cold"] = M.run_pass(L, timed_step, device=disk)
        say(f"  loader + step, cold ({eviction2}): {passes['cold']['rate']:.1f} samples/s")
        del L
        M.collect()

        # ---------------------------------------------------------------- model
        inp, notes = _model_inputs(passes, n, dbytes, cpus, G, c_step, kind, workers, cache)
        inp.step_cores = k_step
        inp.model_error, held_out = _model_error(inp, passes, workers, model_error)
        fractions = [i / 10 for i in range(11)]
        wlist = list(range(1, max_workers + 1))
        rc, rf = passes["cached"]["rate"], passes["cold"]["rate"]
        now = model.predict(inp, 0.0, workers)
        cached_p = model.predict(inp, 1.0, workers)
        measured_stalls = model.stalls(G.value, rc, rf)
        vd = model.verdict(now, model.predict(inp, 0.0, workers, no_fetch=True),
                           model.predict(inp, 0.0, workers, no_prep=True),
                           model_error=inp.model_error.value, measured=measured_stalls)
        per_sample = dbytes / n
        cold_dev = passes["fetch_cold"]["device_bytes"]
        measured_names = sorted(k for k, v in inp.__dict__.items() if isinstance(v, model.Est)
                                and v.source.startswith("measured"))
        report = {
            "version": 2,
            "dataset": {"source": source, "samples": n, "bytes": dbytes, "bytes_source": bytes_source,
                        "files": len(files), "transform": tf_desc},
            "settings": {"batch_size": batch_size, "workers": workers, "cache": cache, "cache_size": cache_size,
                         "fetch_threads": fetch_threads, "cpus": cpus, "max_workers": max_workers,
                         "scaling_workers": scaling, "step": step if isinstance(step, str) else
                         (getattr(step, "__qualname__", repr(step)) if step is not None else None),
                         "rate": rate, "repeats": repeats, "step_kind": kind, "step_kind_given": step_kind,
                         "device": None if device is None else str(device)},
            "eviction": {"cold_fetch_pass": eviction, "cold_pass": eviction2},
            "rates": {"ingest": G.value, "ingest_source": G.source, "cached": rc, "cold": rf,
                      "prep": {str(k): v for k, v in prep.items()}, "fetch_cold": passes["fetch_cold"]["rate"],
                      "fetch_warm": passes["fetch_warm"]["rate"]},
            "bandwidth": {
                "storage": inp.storage_bw.value, "cache": inp.cache_bw.value,
                "storage_source": "fetch-only cold pass: samples/s x mean sample bytes (dataset bytes / samples)",
                "cache_source": f"fetch-only warm pass from the {cache} cache, same formula",
                "storage_loader_bytes": passes["fetch_cold"]["bytes_storage"],
                "storage_device": disk.disk,
                "storage_device_bytes": cold_dev,
                "storage_device_note": ("sectors read on /sys/block/%s/stat during the cold fetch pass (all readers "
                                        "of that disk count)" % disk.disk) if disk.disk else
                                       "no block device behind the dataset (or not a local file dataset)",
                "mean_sample_bytes": per_sample,
            },
            "stalls": measured_stalls,
            "model": {
                "inputs": inp.as_dict(),
                "measured": measured_names,
                "modelled": sorted(k for k, v in inp.__dict__.items() if isinstance(v, model.Est)
                                   and k not in measured_names),
                "notes": notes,
                "description": model.__doc__.split("\n\n")[1].replace("\n", " "),
            },
            "verdict": vd,
            "recommendations": recommend(vd, ds),
            "what_if": {
                "cache": model.what_if_cache(inp, workers, fractions),
                "workers_cold": model.what_if_workers(inp, 0.0, wlist, prep),
                "workers_cached": model.what_if_workers(inp, 1.0, wlist, prep),
                "grid": model.what_if_grid(inp, fractions, wlist),
                "serial_fraction": inp.amdahl_s.as_dict(),
            },
            "check": {"cold_predicted": now["throughput"], "cold_lo": now["lo"], "cold_hi": now["hi"],
                      "cold_bound": now["bound"], "cold_measured": rf,
                      "cached_predicted": cached_p["throughput"], "cached_lo": cached_p["lo"],
                      "cached_hi": cached_p["hi"], "cached_bound": cached_p["bound"], "cached_measured": rc},
            "passes": passes,
            "seconds": time.perf_counter() - t_all,
        }
        report["check"].update({"cold_lo_inputs": now["lo_inputs"], "cold_hi_inputs": now["hi_inputs"],
                                "cached_lo_inputs": cached_p["lo_inputs"], "cached_hi_inputs": cached_p["hi_inputs"],
                                "model_error": inp.model_error.value, "model_error_source": inp.model_error.source,
                                "held_out_errors": held_out})
        for k in ("cold", "cached"):
            c = report["check"]
            c[f"{k}_error"] = c[f"{k}_predicted"] / c[f"{k}_measured"] - 1
            c[f"{k}_in_interval"] = c[f"{k}_lo"] <= c[f"{k}_measured"] <= c[f"{k}_hi"]
            c[f"{k}_in_inputs_interval"] = c[f"{k}_lo_inputs"] <= c[f"{k}_measured"] <= c[f"{k}_hi_inputs"]
        short = [k for k, p in passes.items() if p.get("short")]
        report["warnings"] = []
        if short:
            report["warnings"].append(f"passes {', '.join(short)} had no more batches than workers: timed from "
                                      f"iter(), start-up included; use more samples for steady-state rates")
        if cache == "node" and passes["fetch_warm"]["bytes_cache"] < 0.95 * dbytes:
            report["warnings"].append(
                f"the node cache held only {passes['fetch_warm']['bytes_cache'] / max(dbytes, 1):.0%} of the dataset in "
                f"the warm pass (/dev/shm too small?): cached rates are partly from storage")
        if not files:
            report["warnings"].append("no local files behind the dataset: nothing was evicted, the cold passes read "
                                      "whatever raw() reads")
        lost = [k for k, p in passes.items() if p.get("cpu_children_lost")]
        if lost:
            report["warnings"].append(f"worker processes exited inside the timed window of {', '.join(lost)}: their "
                                      f"CPU is undercounted")
        for k in ("cold", "cached"):
            c = report["check"]
            if not c[f"{k}_in_interval"]:
                report["warnings"].append(
                    f"the model's {k} prediction {c[f'{k}_predicted']:.1f} [{c[f'{k}_lo']:.1f}, {c[f'{k}_hi']:.1f}] does "
                    f"not hold the measured {c[f'{k}_measured']:.1f}: treat the what-if tables with care (a busy "
                    f"machine, or a pipeline the model does not describe)")
        if model_error is None and inp.model_error.value > MODEL_ERROR_FLOOR:
            report["warnings"].append(
                f"the model missed its own check passes by up to {inp.model_error.value:.0%} (more than the "
                f"{MODEL_ERROR_FLOOR:.0%} it is expected to hold): every interval is widened by that; treat the what-if "
                f"tables with care (a busy machine, or a pipeline the model does not describe)")
        return report
    looks = [look()]
    if model_error is None and looks[0]["check"]["model_error"] > MODEL_ERROR_VERDICT:
        # A pass disturbed by other work on the machine: one second look, and the look whose own check
        # passes the model described better is the report (each look is self-consistent).
        say(f"  the model missed its own check passes by {looks[0]['check']['model_error']:.0%} (a busy machine?): "
            f"measuring once more")
        looks.append(look())
    report = min(looks, key=lambda r: r["check"]["model_error"])
    report["looks"] = [{"model_error": r["check"]["model_error"], "verdict": r["verdict"]["largest"],
                        "conclusive": r["verdict"]["conclusive"], "seconds": r["seconds"]} for r in looks]
    if len(looks) > 1:
        report["warnings"].append(
            f"the first look's model error was {looks[0]['check']['model_error']:.0%}, past the "
            f"{MODEL_ERROR_VERDICT:.0%} a verdict needs: everything was measured once more and this report is "
            f"the look with the smaller error ({report['check']['model_error']:.0%})")
    return report


def _typical(M, loader, step, repeats: int, keep_batch: bool = False) -> dict:
    """``repeats`` passes of ``loader``: the pass whose rate is nearest the
    median, with ``rate`` set to the median of all (every rate kept in
    ``rates``).  The median, not the fastest: what the model predicts is the
    rate a training run sustains, and the fastest of several passes is an
    optimistic estimate of that (on this VM a CPU-bound pass moves both ways
    by 10-30% from one minute to the next; picking the fastest made every
    prep-bound prediction of benchmarks/analyze_validate.py too high)."""
    runs = [M.run_pass(loader, step, keep_batch=keep_batch and k == 0) for k in range(repeats)]
    rates = [r["rate"] for r in runs]
    med = statistics.median(rates)
    chosen = min(runs, key=lambda r: abs(r["rate"] - med))
    if keep_batch and "batch" not in chosen:
        chosen["batch"] = runs[0]["batch"]
    chosen["rate"] = med
    chosen["rates"] = rates
    for k in ("cpu_self", "cpu_children", "cpu_main", "wait_children"):
        if k not in chosen:
            continue
        vals = [r[k] for r in runs]
        chosen[f"{k}_runs"] = vals
        chosen[k] = statistics.median(vals)
    return chosen


# -------------------------------------------- the steps analyze() shares
def _open_dataset(root, dataset, transform, max_samples):
    """The dataset the passes read: ``(dataset, source, transform description)``."""
    from ..protocol import is_two_stage
    from . import measure as M

    if (root is None) == (dataset is None):
        raise ValueError(f"give exactly one of root (an ImageFolder directory) and dataset (a two-stage dataset "
                         f"or \"module:callable\"), but got root={root!r}, dataset={dataset!r}")
    if root is not None:
        from .. import ImageFolder
        source = os.fspath(root)
        ds = ImageFolder(source, transform=M.make_transform(transform))
        tf_desc = TRANSFORMS[transform][1] if isinstance(transform, str) and transform in TRANSFORMS else repr(transform)
    else:
        source = dataset if isinstance(dataset, str) else type(dataset).__name__
        ds = M.load_callable(dataset, "dataset")() if isinstance(dataset, str) else dataset
        tf_desc = "(the dataset's own)"
    from ..tvcompat import adapt

    ds, tv = adapt(ds)   # torchvision's ImageFolder: the two-stage dataset coordl.DataLoader would run
    if not is_two_stage(ds):
        why = f" ({tv.reason})" if tv is not None else ""
        raise ValueError(f"the analyzer needs a two-stage dataset (raw(i) -> bytes, prep(raw, i) -> sample) to "
                         f"time fetch and prep apart, but {source!r} gave a {type(ds).__name__} without raw/prep"
                         f"{why}; use coordl.ImageFolder or wrap the dataset with coordl.datasets.two_stage")
    if max_samples is not None:
        _check_pos_int(max_samples, "max_samples")
        if max_samples < len(ds):
            ds = M.Subset(ds, max_samples)
    if len(ds) < 1:
        raise ValueError(f"the dataset {source!r} is empty")
    return ds, source, tf_desc


def _dataset_bytes(ds) -> tuple[int, str]:
    n = len(ds)
    sizes = getattr(ds, "sizes", None)
    if sizes is not None and len(sizes) == n and min(int(s) for s in sizes) >= 0:
        return int(sum(int(s) for s in sizes)), "dataset.sizes"
    return sum(len(ds.raw(i)) for i in range(n)), "len(raw(i)) of every sample"


def _choose_cache(cache: str, ds, dbytes: int) -> tuple[str, int]:
    """Where the in-memory passes read from, and the node cache size (0: the page cache)."""
    import psutil

    fp = callable(getattr(ds, "fingerprint", None))
    if cache == "auto":
        cache = "node" if fp and dbytes < psutil.virtual_memory().available // 4 else "page"
    elif cache == "node" and not fp:
        raise ValueError(f"cache='node' needs a dataset with fingerprint() (coordl.ImageFolder has one); "
                         f"{type(ds).__name__} has none: use cache='page'")
    return cache, (dbytes + dbytes // 20 + _MiB if cache == "node" else 0)


def _loader_factory(batch_size: int, fetch_threads: int | None, device: Any = None):
    """Loaders as the analyzer's passes use them.  Workers are persistent so
    they are alive when a pass's CPU is read at its end (and repeats of a
    pass do not pay start-up again)."""
    from .. import DataLoader

    def loader(d, w, size):
        kw = {} if fetch_threads is None else {"fetch_threads": fetch_threads}
        if w > 0:
            kw["persistent_workers"] = True
        if device is not None:
            kw["device"] = device
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "cache_size has no effect" is reported by us instead
            return DataLoader(d, batch_size=batch_size, shuffle=True, num_workers=w, seed=0,
                              cache_size=size or None, **kw)
    return loader


def _prep_passes(loader, ds, counts, cache_size: int, repeats: int, say, keep_batch: bool = False):
    """Step 3 of :func:`analyze`: the prep-only pass (loader, no step, data in
    memory: the caller keeps the node cache filled) at each worker count in
    ``counts``, the median of ``repeats``.  Returns ``(P, passes, batch)``:
    ``P`` maps worker counts >= 1 to samples/s, ``passes`` holds each pass
    as ``prep_<w>w``, ``batch`` is a copy of the first batch when
    ``keep_batch`` (else ``None``)."""
    from . import measure as M

    prep: dict[int, float] = {}
    passes: dict[str, dict] = {}
    batch = None
    for w in counts:
        L = loader(ds, w, cache_size)
        r = _typical(M, L, None, repeats, keep_batch=keep_batch and batch is None)
        kept = r.pop("batch", None)
        if batch is None:
            batch = kept
        passes[f"prep_{w}w"] = r
        if w:
            prep[w] = r["rate"]
        say(f"  prep only, {w} workers: {r['rate']:.1f} samples/s")
        del L
        M.collect()
    return prep, passes, batch


def measure_prep(root: str | os.PathLike | None = None, *, dataset: Any = None, transform: Any = "rrc224",
                 batch_size: int = 32, workers: Sequence[int] = (1, 2), max_samples: int | None = None,
                 cache: str = "auto", fetch_threads: int | None = None, repeats: int = 1,
                 log: Callable[[str], None] | None = print) -> dict:
    """Only the prep rates ``P(w)`` of :func:`analyze` (its step 3), by the
    same code: the same dataset, loader settings and in-memory source, each
    worker count's prep-only pass the median of ``repeats``.  For measuring
    ``P(w)`` again next to something else (benchmarks/analyze_validate.py
    alternates it with the loader it predicts) without the other passes.

    Before the prep passes, one fetch-only pass brings the dataset into
    memory (with ``cache="node"`` it fills the node cache, which that loader
    keeps alive until the prep passes are done), as the cold fetch pass
    does in :func:`analyze`; nothing is evicted first.  Arguments as in
    :func:`analyze`; ``workers`` is the list of worker counts (each >= 1).

    Returns ``{"prep": {"<w>": samples/s}, "passes": {"fill": ...,
    "prep_<w>w": ...}, "dataset": {"source", "samples", "bytes"},
    "settings": {...}, "seconds"}`` (JSON-ready).
    """
    from . import measure as M

    say = log or (lambda _msg: None)
    _check_pos_int(batch_size, "batch_size")
    _check_pos_int(repeats, "repeats")
    if isinstance(workers, (int, str)) or not hasattr(workers, "__iter__"):
        raise ValueError(f"workers should be a list of worker counts (each >= 1), but got workers={workers!r}")
    counts = sorted({_check_pos_int(w, "workers[i]") for w in workers})
    if not counts:
        raise ValueError(f"workers should be a list of worker counts (each >= 1), but got workers={workers!r}")
    if cache not in ("auto", "node", "page"):
        raise ValueError(f'cache should be "auto", "node" or "page", but got cache={cache!r}')
    ds, source, _tf = _open_dataset(root, dataset, transform, max_samples)
    dbytes, _src = _dataset_bytes(ds)
    cache, cache_size = _choose_cache(cache, ds, dbytes)
    loader = _loader_factory(batch_size, fetch_threads)
    t0 = time.perf_counter()
    F = loader(M.FetchOnly(ds), max(counts), cache_size)
    passes = {"fill": M.run_pass(F)}
    say(f"  fetch only, filling the {cache} cache: {passes['fill']['rate']:.1f} samples/s")
    prep, prep_passes, _ = _prep_passes(loader, ds, counts, cache_size, repeats, say)
    passes.update(prep_passes)
    del F
    M.collect()
    return {"prep": {str(k): v for k, v in prep.items()}, "passes": passes,
            "dataset": {"source": source, "samples": len(ds), "bytes": dbytes},
            "settings": {"batch_size": batch_size, "workers": counts, "cache": cache, "cache_size": cache_size,
                         "fetch_threads": fetch_threads, "repeats": repeats},
            "seconds": time.perf_counter() - t0}

# ------------------------------------------------------------------ output
def predict(report: dict, cached_fraction: float, workers: int) -> dict:
    """The report's model at a point it may not have measured: a fraction
    ``cached_fraction`` of the dataset in the node cache and ``workers``
    workers.  Returns ``{"throughput", "lo", "hi", "lo_inputs", "hi_inputs",
    "model_error", "bound", "bounds"}``: ``lo``/``hi`` is the interval with
    the model's own error, ``lo_inputs``/``hi_inputs`` the inputs' spread
    alone.  Works on a report read back from the JSON."""
    return model.predict_from_report(report, cached_fraction, workers)
