"""The model's inputs from the analyzer's passes, and the model's own error.

:func:`coordl.analyze.analyze` runs the passes; here their figures become
:class:`~coordl.analyze.model.Inputs` (storage and cache bandwidth, the
loader's, workers' and consuming thread's CPU per sample, the share of the
cores the pipeline gets, the Amdahl fit of prep over worker counts), each an
estimate with its spread and a note on how it was made, and the model's own
error is taken from the passes it predicts without fitting to them.
``MODEL_ERROR_FLOOR`` and ``MODEL_ERROR_CAP`` are public in
:mod:`coordl.analyze`.
"""
from __future__ import annotations

import statistics

from . import model


#: The model error every interval carries at least (``analyze(model_error=None)``).  Its source: the
#: analyzer's inputs moved by about 10% between runs on the same idle 2-core VM (two analyzer runs 10 minutes
#: apart measured P(1) = 615 and 691 samples/s and 1.54 and 1.39 prep CPU-ms a sample; a prep-only pass and a
#: loader epoch 30 s apart, ratios 0.93-1.17: docs/benchmarks.md's history), more than the spread of
#: back-to-back repeats, which is all an input's own interval holds.
MODEL_ERROR_FLOOR = 0.10
# the largest model error an interval carries (hi = hi_inputs / (1 - e)); past it the warning says why
MODEL_ERROR_CAP = 0.85


def _model_error(inp, passes: dict, workers: int, given: float | None) -> tuple:
    """The model's own error (an :class:`model.Est`) and the held-out
    checks it was taken from: the cold and cached loader + step passes at
    ``workers`` are predicted by the model (no input is fitted to them), so
    their relative errors are errors on points the model has not seen.
    ``given``: the user's figure instead."""
    held = {}
    for name, x in (("cold", 0.0), ("cached", 1.0)):
        p = model.predict(inp, x, workers)
        held[name] = p["throughput"] / passes[name]["rate"] - 1
    if given is not None:
        return model.Est.exact(float(given), "given (model_error=)"), held
    worst = max(abs(v) for v in held.values())
    e = min(max(MODEL_ERROR_FLOOR, worst), MODEL_ERROR_CAP)
    src = (f"modelled: the larger of {MODEL_ERROR_FLOOR:.0%} (run-to-run drift of the inputs on an idle machine) "
           f"and the model's error on its own cold and cached loader + step passes "
           f"({held['cold']:+.1%}, {held['cached']:+.1%})"
           + (f", capped at {MODEL_ERROR_CAP:.0%}" if worst > MODEL_ERROR_CAP else ""))
    return model.Est(e, e, e, src), held


def _runs(p: dict, key: str = "rate") -> list:
    """The values of ``key`` in each repeat of a pass (``_typical`` keeps them)."""
    return p.get(f"{key}s" if key == "rate" else f"{key}_runs", [p[key]])


def _model_inputs(passes: dict, n: int, dbytes: int, cpus: int, G, c_step, kind: str, workers: int,
                  cache: str) -> tuple:
    """The model's inputs (:class:`model.Inputs`) from the passes, and notes
    saying how each modelled one was made."""
    E = model.est_from_samples
    per = dbytes / n
    fc, fw = passes["fetch_cold"], passes["fetch_warm"]
    s_bw = E([fc["rate"] * per], "measured: fetch-only pass after eviction", fc.get("segments", ()))
    c_bw = E([r * per for r in _runs(fw)], f"measured: fetch-only passes from the {cache} cache",
             fw.get("segments", ()) if len(_runs(fw)) == 1 else ())
    preps = {int(k[5:-1]): p for k, p in passes.items() if k.startswith("prep_") and k != "prep_0w"}
    pp = list(preps.values()) or [passes["prep_0w"]]
    loader_runs = [v for p in pp for v in _runs(p, "cpu_self")]
    a = E(loader_runs, "measured: loader process CPU per sample in the prep-only passes (fetch threads from "
                       "memory, batch assembly)")
    warm_cpu = _runs(fw, "cpu_self")
    extra = fc["cpu_self"] - statistics.median(warm_cpu)
    a_cold = model.Est(max(extra, 0.0), max(fc["cpu_self"] - max(warm_cpu), 0.0),
                       max(fc["cpu_self"] - min(warm_cpu), extra, 0.0),
                       "measured: loader CPU per sample, cold fetch-only pass minus warm")
    m = E([v for p in pp for v in _runs(p, "cpu_main")],
          "measured: the consuming thread's CPU per sample in the prep-only passes")
    b = {w: E(_runs(p, "cpu_children"), f"measured: worker CPU per sample, prep-only at {w} workers")
         for w, p in preps.items()}
    notes = []
    # eta: the share of the cores the pipeline was seen to get where the cores were the limit
    util = [r * (a.value + b[w].value) / cpus for w, p in preps.items() if w >= cpus for r in _runs(p)]
    # were those passes limited by the cores? Their workers were, if they were running or waiting for a core
    # (run queue) most of the time; a worker that waits on something else (a sleep, I/O) is not
    runnable = [p["rate"] * (p["cpu_children"] + p.get("wait_children", 0.0)) / w
                for w, p in preps.items() if w >= cpus]
    if util and statistics.median(runnable) < 0.5:
        notes.append(f"the workers of the prep-only passes at >= {cpus} workers were running or waiting for a core "
                     f"only {statistics.median(runnable):.0%} of the time: prep waits on something else there, so "
                     f"the cores are not its limit")
        util = []
    elif util and statistics.median(util) < 0.5:
        notes.append(f"the prep-only passes at >= {cpus} workers got only {statistics.median(util):.0%} of the "
                     f"cores while their workers were waiting for one: the machine is shared (figures from a busy "
                     f"machine hold for that load only)")
    if util:
        eta = model.Est(min(statistics.median(util), 1.0), min(min(util), 1.0), min(max(util), 1.0),
                        f"measured: CPU-seconds per second the prep-only passes at >= {cpus} workers got, per core")
    else:
        eta = model.Est(1.0, 0.9, 1.0, "modelled: no pass had as many workers as cores; all cores assumed")
        notes.append("eta (share of the cores the pipeline gets) not measured: no prep pass had >= cores workers")
    cap = {w: eta.value * cpus / (a.value + b[w].value) for w in preps}
    if preps:
        fit = model.fit_amdahl({w: _runs(p) for w, p in preps.items()}, cap)
    else:
        r0 = passes["prep_0w"]["rate"]
        fit = {"s": model.Est(0.0, 0.0, 1.0, "modelled: no worker counts measured"),
               "p1": model.Est(r0, r0, r0, "measured: in-process prep"), "draws": [], "points": 0}
    if len(preps) < 3:
        notes.append(f"prep measured at {len(preps)} worker count(s): the Amdahl fit's serial fraction is "
                     f"poorly known (measure three or more: scaling_workers)")
    inp = model.Inputs(samples=n, dataset_bytes=dbytes, cores=cpus, storage_bw=s_bw, cache_bw=c_bw, ingest=G,
                       step_cpu=c_step, loader_cpu=a, storage_cpu=a_cold, worker_cpu=b, amdahl_s=fit["s"],
                       amdahl_p1=fit["p1"], eta=eta, step_kind=kind, amdahl_draws=fit["draws"], consumer_cpu=m)
    return inp, notes
