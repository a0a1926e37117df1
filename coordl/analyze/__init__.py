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

From them: fetch and prep stall (:func:`coordl.analyze.model.stalls`) and
what-if tables (:mod:`coordl.analyze.model`).  See docs/api.md
("coordl analyze").

    from coordl.analyze import analyze, format_report
    report = analyze(root="/data/train", transform="rrc224", batch_size=64, workers=4, rate=2000)
    print(format_report(report))
"""
from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from typing import Any, Callable, Sequence

from . import model
from .measure import TRANSFORMS

__all__ = ["analyze", "measure_prep", "format_report", "write_json", "write_plot", "model", "TRANSFORMS"]

_MiB = 2 ** 20


def _check_pos_int(v, name):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} should be a positive int, but got {name}={v!r}")
    return v


def analyze(root: str | os.PathLike | None = None, *, dataset: Any = None, transform: Any = "rrc224",
            batch_size: int = 32, workers: int = 2, step: Callable | str | None = None,
            rate: float | None = None, max_samples: int | None = None, cache: str = "auto",
            evict: str = "auto", scaling_workers: Sequence[int] = (1, 2), max_workers: int | None = None,
            fetch_threads: int | None = None, ingest_seconds: float = 2.0, repeats: int = 1,
            log: Callable[[str], None] | None = print) -> dict:
    """Run the differential measurement and return the report (a dict, JSON-ready).

    Args:
        root: an ImageFolder directory (``coordl.ImageFolder(root, transform)``).
        dataset: instead of ``root``: a two-stage dataset object, or
            ``"module:callable"`` / ``"file.py:callable"`` returning one
            (called without arguments; ``transform`` is then not used).
        transform: for ``root``: a name in :data:`TRANSFORMS`, a
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
        cache: where the "in memory" passes read from: ``"node"`` (a coordl
            node cache holding the whole dataset in /dev/shm), ``"page"``
            (the OS page cache), ``"auto"`` (node when the dataset has a
            fingerprint and fits in a quarter of available memory).
        evict: how cold passes start cold: ``"auto"`` (drop_caches as root,
            else fadvise), ``"drop_caches"``, ``"fadvise"``.
        scaling_workers: worker counts whose prep rate is measured (besides
            ``workers``), for the workers what-if.
        max_workers: the workers what-if goes up to this (default: the CPUs
            this process may use, at least ``workers``).
        fetch_threads: passed to the loader.
        ingest_seconds: how long the step alone runs.
        repeats: run each in-memory pass (fetch warm, prep, cached) this
            many times and use the median rate, which a busy or noisy
            machine moves less than a single pass (cold passes run once).
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
    device = M.DeviceCounter(files[0] if files else None)
    cache, cache_size = _choose_cache(cache, ds, dbytes)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if max_workers is None:
        max_workers = max(cpus, workers, max(scaling))
    _check_pos_int(max_workers, "max_workers")
    loader = _loader_factory(batch_size, fetch_threads)

    say(f"coordl analyze: {n} samples, {dbytes / _MiB:.1f} MiB ({source}), batch {batch_size}, "
        f"{workers} workers, in-memory passes from the {cache} cache")
    passes: dict[str, dict] = {}
    t_all = time.perf_counter()

    # 1-2: fetch only, cold then warm (same loader: with the node cache the first pass fills it)
    eviction = M.evict(files, evict)
    F = loader(M.FetchOnly(ds), workers, cache_size)
    passes["fetch_cold"] = M.run_pass(F, device=device)
    say(f"  fetch only, cold ({eviction}): {passes['fetch_cold']['rate']:.1f} samples/s")
    passes["fetch_warm"] = _typical(M, F, None, repeats)
    say(f"  fetch only, warm: {passes['fetch_warm']['rate']:.1f} samples/s")
    # 3: prep only at each worker count (F keeps the node cache alive)
    prep, prep_passes, batch = _prep_passes(loader, ds, scaling + ([0] if workers == 0 else []), cache_size,
                                            repeats, say, keep_batch=True)
    passes.update(prep_passes)
    # 4: ingestion-free
    if step is not None:
        ing = M.ingest_rate(step_fn, batch, seconds=ingest_seconds)
        passes["ingest"] = ing
        G = ing["rate"]
        ingest_source = "measured: the step alone on one batch in memory"
    else:
        G = float(rate)
        ingest_source = "given (rate=)"
    say(f"  ingestion-free: {G:.1f} samples/s ({ingest_source})")
    del batch
    # 5: cached
    L = loader(ds, workers, cache_size)
    passes["cached"] = _typical(M, L, step_fn, repeats)
    say(f"  loader + step, cached: {passes['cached']['rate']:.1f} samples/s")
    del L, F
    M.collect()
    # 6: cold
    eviction2 = M.evict(files, evict)
    L = loader(ds, workers, 0)
    passes["cold"] = M.run_pass(L, step_fn, device=device)
    say(f"  loader + step, cold ({eviction2}): {passes['cold']['rate']:.1f} samples/s")
    del L
    M.collect()

    # ---------------------------------------------------------------- model
    per_sample = dbytes / n
    s_bw = passes["fetch_cold"]["rate"] * per_sample
    c_bw = passes["fetch_warm"]["rate"] * per_sample
    rc, rf = passes["cached"]["rate"], passes["cold"]["rate"]
    st = model.stalls(G, rc, rf)
    p_w = prep[workers] if workers else passes["prep_0w"]["rate"]
    fractions = [i / 10 for i in range(11)]
    wlist = list(range(1, max_workers + 1))
    f0 = model.fetch_rate(n, dbytes, 0.0, c_bw, s_bw)
    f1 = model.fetch_rate(n, dbytes, 1.0, c_bw, s_bw)
    cold_dev = passes["fetch_cold"]["device_bytes"]
    report = {
        "version": 1,
        "dataset": {"source": source, "samples": n, "bytes": dbytes, "bytes_source": bytes_source,
                    "files": len(files), "transform": tf_desc},
        "settings": {"batch_size": batch_size, "workers": workers, "cache": cache, "cache_size": cache_size,
                     "fetch_threads": fetch_threads, "cpus": cpus, "max_workers": max_workers,
                     "scaling_workers": scaling, "step": step if isinstance(step, str) else
                     (getattr(step, "__qualname__", repr(step)) if step is not None else None),
                     "rate": rate, "repeats": repeats},
        "eviction": {"cold_fetch_pass": eviction, "cold_pass": eviction2},
        "rates": {"ingest": G, "ingest_source": ingest_source, "cached": rc, "cold": rf,
                  "prep": {str(k): v for k, v in prep.items()}, "fetch_cold": passes["fetch_cold"]["rate"],
                  "fetch_warm": passes["fetch_warm"]["rate"]},
        "bandwidth": {
            "storage": s_bw, "cache": c_bw,
            "storage_source": "fetch-only cold pass: samples/s x mean sample bytes (dataset bytes / samples)",
            "cache_source": f"fetch-only warm pass from the {cache} cache, same formula",
            "storage_loader_bytes": passes["fetch_cold"]["bytes_storage"],
            "storage_device": device.disk,
            "storage_device_bytes": cold_dev,
            "storage_device_note": ("sectors read on /sys/block/%s/stat during the cold fetch pass (all readers "
                                    "of that disk count)" % device.disk) if device.disk else
                                   "no block device behind the dataset (or not a local file dataset)",
        },
        "stalls": st,
        "what_if": {
            "cache": model.what_if_cache(n, dbytes, c_bw, s_bw, p_w, G, fractions),
            "workers_cold": model.what_if_workers(prep, cpus, f0, G, wlist) if prep else [],
            "workers_cached": model.what_if_workers(prep, cpus, f1, G, wlist) if prep else [],
            "grid": model.what_if_grid(n, dbytes, c_bw, s_bw, prep, cpus, G, fractions, wlist) if prep else [],
            "serial_fraction": model.fit_serial_fraction(prep) if prep else None,
            "model": ("T_fetch = D*x/C_bw + D*(1-x)/S_bw per epoch; throughput = min(N/T_fetch, P(w), G); "
                      "P(w) measured where measured, else Amdahl P(1)*w/(1+s*(w-1)) fitted to the measured "
                      "points, flat past the CPU count"),
        },
        "check": {
            "cold_predicted": model.predict(f0, p_w, G), "cold_measured": rf,
            "cached_predicted": model.predict(f1, p_w, G), "cached_measured": rc,
        },
        "passes": passes,
        "seconds": time.perf_counter() - t_all,
    }
    for k in ("cold", "cached"):
        report["check"][f"{k}_error"] = report["check"][f"{k}_predicted"] / report["check"][f"{k}_measured"] - 1
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
    if not is_two_stage(ds):
        raise ValueError(f"the analyzer needs a two-stage dataset (raw(i) -> bytes, prep(raw, i) -> sample) to "
                         f"time fetch and prep apart, but {source!r} gave a {type(ds).__name__} without raw/prep; "
                         f"use coordl.ImageFolder or wrap the dataset with coordl.datasets.two_stage")
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


def _loader_factory(batch_size: int, fetch_threads: int | None):
    from .. import DataLoader

    def loader(d, w, size):
        kw = {} if fetch_threads is None else {"fetch_threads": fetch_threads}
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
def format_report(r: dict) -> str:
    """The report as text: rates, stalls, bandwidths and the what-if tables."""
    ds, rt, bw, st = r["dataset"], r["rates"], r["bandwidth"], r["stalls"]
    L = []
    L.append(f"dataset: {ds['source']}: {ds['samples']} samples, {ds['bytes'] / _MiB:.1f} MiB; transform "
             f"{ds['transform']}")
    s = r["settings"]
    L.append(f"batch {s['batch_size']}, {s['workers']} workers, {s['cpus']} CPUs; in-memory passes from the "
             f"{s['cache']} cache; cold passes after {r['eviction']['cold_pass']}")
    L.append("")
    L.append(f"{'ingestion-free (step alone)':<34}{rt['ingest']:>10.1f} samples/s  ({rt['ingest_source']})")
    L.append(f"{'cached (prep only + step)':<34}{rt['cached']:>10.1f} samples/s")
    L.append(f"{'cold (fetch + prep + step)':<34}{rt['cold']:>10.1f} samples/s")
    for w, v in rt["prep"].items():
        L.append(f"{f'prep alone, {w} worker(s)':<34}{v:>10.1f} samples/s")
    L.append("")
    L.append(f"fetch stall {st['fetch']:6.1%}   prep stall {st['prep']:6.1%}   (of the cold epoch; "
             f"the step waits {st['total']:.1%} of it)")
    if st["noise"] > 0.05:
        L.append(f"  note: a slower setting measured {st['noise']:.0%} faster than a faster one: noise; "
                 f"rerun with more samples or on a quieter machine")
    dom = "fetch (storage)" if st["fetch"] > st["prep"] else "prep (CPU)"
    if st["total"] < 0.05:
        L.append("verdict: the step is not waiting for data")
    else:
        L.append(f"verdict: the larger stall is {dom}")
    L.append(f"storage bandwidth {bw['storage'] / 1e6:9.1f} MB/s  ({bw['storage_source']})")
    if bw["storage_device_bytes"] is not None:
        L.append(f"  device /dev/{bw['storage_device']} read {bw['storage_device_bytes'] / _MiB:.1f} MiB in that "
                 f"pass; the loader read {bw['storage_loader_bytes'] / _MiB:.1f} MiB from storage")
    L.append(f"cache bandwidth   {bw['cache'] / 1e6:9.1f} MB/s  ({bw['cache_source']})")
    L.append("")
    L.append(f"what if: cached fraction of the dataset ({s['workers']} workers)")
    L.append(f"  {'cached':>7} {'fetch/s':>10} {'samples/s':>10}  bound")
    for row in r["what_if"]["cache"]:
        L.append(f"  {row['cached_fraction']:>7.0%} {row['fetch_rate']:>10.1f} {row['throughput']:>10.1f}  "
                 f"{row['bound']}")
    if r["what_if"]["workers_cold"]:
        L.append(f"what if: CPU workers (serial fraction fitted {r['what_if']['serial_fraction']:.3f})")
        L.append(f"  {'workers':>7} {'prep/s':>10} {'cold':>10} {'cached':>10}")
        for a, b in zip(r["what_if"]["workers_cold"], r["what_if"]["workers_cached"]):
            L.append(f"  {a['workers']:>7} {a['prep_rate']:>10.1f} {a['throughput']:>10.1f} {b['throughput']:>10.1f}"
                     f"  {'measured' if a['measured'] else 'modelled'}")
    c = r["check"]
    L.append(f"model check: cold predicted {c['cold_predicted']:.1f} vs measured {c['cold_measured']:.1f} "
             f"({c['cold_error']:+.0%}), cached {c['cached_predicted']:.1f} vs {c['cached_measured']:.1f} "
             f"({c['cached_error']:+.0%})")
    for w in r.get("warnings", []):
        L.append(f"warning: {w}")
    return "\n".join(L)


def write_json(report: dict, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")


def write_plot(report: dict, path: str | os.PathLike) -> str | None:
    """Write the what-if tables as a PNG.  Returns ``None`` when written, or
    why not (matplotlib is optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no PNG written"
    wi, rt = report["what_if"], report["rates"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["cached_fraction"] * 100 for r in wi["cache"]]
    a.plot(xs, [r["throughput"] for r in wi["cache"]], "o-", label="predicted")
    top = 1.25 * max([r["throughput"] for r in wi["cache"]] + [rt["cold"], rt["cached"]])
    if rt["ingest"] <= top:
        a.axhline(rt["ingest"], ls=":", c="gray", label="ingestion-free")
    else:
        a.plot([], [], " ", label=f"ingestion-free {rt['ingest']:.0f}/s (off the scale)")
    a.set_ylim(0, top)
    a.plot([0], [rt["cold"]], "x", c="red", label="measured cold")
    a.plot([100], [rt["cached"]], "x", c="green", label="measured cached")
    a.set_xlabel("dataset cached (%)")
    a.set_ylabel("samples/s")
    a.set_title(f"cache size ({report['settings']['workers']} workers)")
    a.legend(fontsize=8)
    if wi["workers_cold"]:
        ws = [r["workers"] for r in wi["workers_cold"]]
        b.plot(ws, [r["throughput"] for r in wi["workers_cold"]], "o-", label="predicted, cold")
        b.plot(ws, [r["throughput"] for r in wi["workers_cached"]], "s-", label="predicted, cached")
        b.plot(ws, [r["prep_rate"] for r in wi["workers_cold"]], ":", label="prep rate")
        b.set_xticks(ws)
        b.set_ylim(bottom=0)
        b.set_xlabel("CPU workers")
        b.set_title("workers (samples/s)")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
