"""The analyzer's report as people read it: the text table
(:func:`format_report`), the JSON file (:func:`write_json`), the plot
(:func:`write_plot`, where matplotlib is installed) and what to change
(:func:`recommend`)."""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["format_report", "write_json", "write_plot", "recommend", "verdict_text", "step_words"]

_MiB = 2 ** 20


def _iv(v: float, lo: float, hi: float, width: int = 10) -> str:
    return f"{v:>{width}.1f} [{lo:.1f}, {hi:.1f}]"


def step_words(kind: str) -> str:
    """``"a CPU step"`` / ``"an accelerator step"``."""
    return "a CPU step" if kind == "cpu" else f"an {kind} step" if kind[:1] in "aeiou" else f"a {kind} step"


def verdict_text(v: dict, stalls: dict) -> str:
    """The verdict line: the largest stall, none, or why there is no conclusion."""
    if v.get("conclusive", True) is False:
        return f"verdict: cannot conclude: {v['why']}"
    if v["largest"] is None:
        return "verdict: the step is not waiting for data (neither removal saves 5%)"
    return (f"verdict: the largest stall is {v['largest']} ({'storage' if v['largest'] == 'fetch' else 'CPU'}): "
            f"removing it helps most (x{v['speedup_without_' + v['largest']]:.2f}; measured "
            f"{stalls[v['largest']]:.1%} of the cold epoch)")


def format_report(r: dict) -> str:
    """The report as text: inputs (measured or modelled, with intervals),
    the verdict, and the what-if tables with intervals."""
    ds, rt, bw, st = r["dataset"], r["rates"], r["bandwidth"], r["stalls"]
    inp = r["model"]["inputs"]
    L = []
    L.append(f"dataset: {ds['source']}: {ds['samples']} samples, {ds['bytes'] / _MiB:.1f} MiB; transform "
             f"{ds['transform']}")
    s = r["settings"]
    L.append(f"batch {s['batch_size']}, {s['workers']} workers, {s['cpus']} CPUs; in-memory passes from the "
             f"{s['cache']} cache; cold passes after {r['eviction']['cold_pass']}; each in-memory pass run "
             f"{s['repeats']}x (value = median, interval = range)")
    L.append("")
    L.append("measured passes (samples/s):")
    L.append(f"  {'step alone':<30}{rt['ingest']:>10.1f}  ({rt['ingest_source']}; {step_words(s['step_kind'])})")
    L.append(f"  {'loader + step, cached':<30}{rt['cached']:>10.1f}")
    L.append(f"  {'loader + step, cold':<30}{rt['cold']:>10.1f}")
    for w, v in rt["prep"].items():
        L.append(f"  {f'prep only, {w} worker(s)':<30}{v:>10.1f}")
    L.append("")
    L.append("model inputs (value [interval]; where from):")
    unit = {"storage_bw": (1e-6, "MB/s"), "cache_bw": (1e-6, "MB/s"), "ingest": (1, "samples/s"),
            "step_cpu": (1e3, "CPU-ms/sample"), "loader_cpu": (1e3, "CPU-ms/sample"),
            "storage_cpu": (1e3, "CPU-ms/sample"), "consumer_cpu": (1e3, "CPU-ms/sample"), "amdahl_s": (1, ""), "amdahl_p1": (1, "samples/s"),
            "eta": (1, "of the cores")}
    for k, (f, u) in unit.items():
        e = inp[k]
        L.append(f"  {k:<12}{e['value'] * f:>10.3f} [{e['lo'] * f:.3f}, {e['hi'] * f:.3f}] {u:<14} {e['source']}")
    for w, e in inp["worker_cpu"].items():
        L.append(f"  {'prep CPU ' + w + 'w':<12}{e['value'] * 1e3:>10.3f} [{e['lo'] * 1e3:.3f}, {e['hi'] * 1e3:.3f}] "
                 f"{'CPU-ms/sample':<14} {e['source']}")
    sc = inp.get("step_cores")
    if sc is not None:
        L.append(f"  {'step_cores':<12}{sc['value']:>10.3f} [{sc['lo']:.3f}, {sc['hi']:.3f}] {'cores':<14} {sc['source']}")
    L.append(f"  cores       {inp['cores']:>10d}   (len(os.sched_getaffinity(0)))")
    me = inp.get("model_error")
    if me is not None:
        L.append(f"  model error {me['value']:>10.1%}   every interval below is the inputs' spread widened by this "
                 f"(lo/(1+e), hi/(1-e)); {me['source']}")
    for note in r["model"]["notes"]:
        L.append(f"  note: {note}")
    L.append("")
    L.append(f"measured stalls (DS-Analyzer differential): fetch {st['fetch']:.1%}, prep {st['prep']:.1%} "
             f"of the cold epoch")
    v = r["verdict"]
    L.append(f"model: removing the fetch stall (all data in memory) -> x{v['speedup_without_fetch']:.2f}; "
             f"removing the prep stall (free prep) -> x{v['speedup_without_prep']:.2f}; cold run bound by "
             f"{v['bound_now']}")
    L.append(verdict_text(v, st))
    for rec in r.get("recommendations", []):
        L.append(f"{'recommendation' if rec.get('applies', True) else 'not applicable'}: {rec['option']}: "
                 f"{rec['why']}")
    L.append(f"storage bandwidth {bw['storage'] / 1e6:9.1f} MB/s  ({bw['storage_source']})")
    if bw["storage_device_bytes"] is not None:
        L.append(f"  device /dev/{bw['storage_device']} read {bw['storage_device_bytes'] / _MiB:.1f} MiB in that "
                 f"pass; the loader read {bw['storage_loader_bytes'] / _MiB:.1f} MiB from storage")
    L.append(f"cache bandwidth   {bw['cache'] / 1e6:9.1f} MB/s  ({bw['cache_source']})")
    L.append("")
    L.append(f"what if: cached fraction of the dataset ({s['workers']} workers); predicted [interval]")
    L.append(f"  {'cached':>7} {'fetch I/O/s':>11} {'samples/s [interval]':>28}  bound")
    for row in r["what_if"]["cache"]:
        L.append(f"  {row['cached_fraction']:>7.0%} {row['fetch_rate']:>11.1f} "
                 f"{_iv(row['throughput'], row['lo'], row['hi'], 10):>28}  {row['bound']}")
    sf = r["what_if"]["serial_fraction"]
    L.append(f"what if: CPU workers (Amdahl serial fraction {sf['value']:.3f} [{sf['lo']:.3f}, {sf['hi']:.3f}], "
             f"capped by the cores)")
    L.append(f"  {'workers':>7} {'prep only [interval]':>26} {'cold [interval]':>26} {'cached [interval]':>26}")
    for a, b in zip(r["what_if"]["workers_cold"], r["what_if"]["workers_cached"]):
        L.append(f"  {a['workers']:>7} {_iv(a['prep_rate'], a['prep_lo'], a['prep_hi'], 8):>26} "
                 f"{_iv(a['throughput'], a['lo'], a['hi'], 8):>26} {_iv(b['throughput'], b['lo'], b['hi'], 8):>26}"
                 f"  {b['bound']:<7} {'(prep measured)' if a['measured'] else '(modelled)'}")
    L.append("  bounds: step (the training thread), fetch (storage + cache bandwidth), workers (their own rate), "
             "cpu (the cores' CPU-seconds), turns (a step on every core and fewer workers than cores: step and prep "
             "run in turn)")
    c = r["check"]
    # a report with a model error gives the check's intervals from the inputs' spread alone
    sfx, what = ("_inputs", " (intervals: inputs' spread only)") if "cold_lo_inputs" in c else ("", "")
    L.append(f"model check{what}: cold predicted "
             f"{_iv(c['cold_predicted'], c['cold_lo' + sfx], c['cold_hi' + sfx], 1)} vs measured "
             f"{c['cold_measured']:.1f} ({c['cold_error']:+.0%}); cached "
             f"{_iv(c['cached_predicted'], c['cached_lo' + sfx], c['cached_hi' + sfx], 1)} vs "
             f"{c['cached_measured']:.1f} ({c['cached_error']:+.0%})")
    for w in r.get("warnings", []):
        L.append(f"warning: {w}")
    return "\n".join(L)


def write_json(report: dict, path: str | os.PathLike) -> None:
    """Write ``report`` (what :func:`analyze` returns) to ``path`` as JSON."""
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
    a.fill_between(xs, [r["lo"] for r in wi["cache"]], [r["hi"] for r in wi["cache"]], alpha=0.2)
    top = 1.25 * max([r["hi"] for r in wi["cache"]] + [rt["cold"], rt["cached"]])
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
    v = report.get("verdict", {})
    if v.get("conclusive", True) is False:   # the tables are the model's: say it cannot stand behind them
        fig.suptitle(f"no verdict: {v['why']}", fontsize=8, wrap=True, color="firebrick")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def recommend(verdict: dict, dataset: Any, gpu: bool | None = None) -> list[dict]:
    """What to change, from the verdict: ``[{"option", "applies", "why"}, ...]``.

    When prep is the largest stall and a GPU is there (``gpu``; None: ask
    ``torch.cuda.is_available()``), decoding on it: ``DataLoader(...,
    device="cuda", decode="device")`` when the dataset's transform is one
    the device stage runs, else why it is not.  (The what-if tables give
    the worker counts and cache sizes.)"""
    if verdict.get("largest") != "prep":
        return []
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    if not gpu:
        return []
    from ..device.encoded import plan_for

    tf = getattr(dataset, "transform", None)
    if tf is None and hasattr(dataset, "dataset"):      # a Subset of the analyzer's
        tf = getattr(dataset.dataset, "transform", None)
    try:
        plan = plan_for(tf)
    except ValueError as e:
        return [{"option": "decode='device'", "applies": False,
                 "why": f"prep (decode and augmentation on the CPU) is the largest stall and a GPU is present, "
                        f"but {e}"}]
    return [{"option": "decode='device'", "applies": True,
             "why": "prep (decode and augmentation on the CPU) is the largest stall and a GPU is present: "
                    "coordl.DataLoader(..., device='cuda', decode='device') decodes the JPEGs on the GPU in one call "
                    f"per batch and runs {plan.describe()} there; the workers only read bytes and JPEG headers "
                    "(docs/guide/gpu.md, \"Decoding on the device\")"}]
