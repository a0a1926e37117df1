"""``coordl analyze`` on the command line (the parser lives here so that
``coordl/cli.py`` only has to hook it in)."""
from __future__ import annotations

import sys

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    from .measure import TRANSFORMS

    a = sub.add_parser("analyze", help="is training waiting for data? fetch and prep stall, bandwidths and "
                                       "what-if tables (cache size, CPU workers)",
                       description="Differential data-stall analysis (CoorDL's DS-Analyzer): measures the "
                                   "ingestion-free, cached and cold rates of a coordl.DataLoader and predicts "
                                   "throughput for other cache sizes and worker counts.")
    a.add_argument("root", nargs="?", default=None, help="an ImageFolder directory (or use --dataset)")
    a.add_argument("--dataset", default=None, help='"module:callable" or "file.py:callable" returning a '
                                                    "two-stage dataset, instead of ROOT")
    a.add_argument("--transform", default="rrc224",
                   help=f"for ROOT: {', '.join(TRANSFORMS)} or \"module:callable\" returning a transform "
                        "(default rrc224)")
    a.add_argument("--batch-size", type=int, default=32)
    a.add_argument("--workers", type=int, default=2)
    g = a.add_mutually_exclusive_group(required=True)
    g.add_argument("--step", default=None, help='the model step: "module:fn" or "file.py:fn", called as fn(batch)')
    g.add_argument("--rate", type=float, default=None, help="a target ingestion rate in samples/s instead of a step")
    a.add_argument("--max-samples", type=int, default=None, help="measure on this many samples (default: all)")
    a.add_argument("--cache", choices=("auto", "node", "page"), default="auto",
                   help="where the in-memory passes read from (default auto: the node cache if the dataset "
                        "fits in a quarter of available memory)")
    a.add_argument("--evict", choices=("auto", "drop_caches", "fadvise"), default="auto",
                   help="how to go cold: drop_caches (root), fadvise (any user), auto (drop_caches when root)")
    a.add_argument("--scaling-workers", default="1,2,3",
                   help="worker counts whose prep rate and CPU cost are measured (default 1,2,3: three or more "
                        "let the fit say whether more workers help)")
    a.add_argument("--max-workers", type=int, default=None, help="workers what-if up to this (default: 2 x CPUs)")
    a.add_argument("--step-kind", choices=("auto", "cpu", "accelerator"), default="auto",
                   help="does the step compute on the CPU or wait on an accelerator? (default auto: measured, "
                        "from the step's CPU-seconds per wall-second alone)")
    a.add_argument("--device", default=None, help="passed to the loader (DataLoader(device=...)), e.g. cuda:0")
    a.add_argument("--fetch-threads", type=int, default=None)
    a.add_argument("--repeats", type=int, default=3, help="run each in-memory pass this many times: the median is "
                                                          "the value, the range the interval (default 3)")
    a.add_argument("--model-error", type=float, default=None,
                   help="the model's own relative error, added to every interval (default: the larger of 10%% and "
                        "the model's error on the analyzer's own cold and cached passes)")
    a.add_argument("--json", default="analyze.json", help="where to write the report (default analyze.json)")
    a.add_argument("--plot", default="analyze.png", help="where to write the PNG (default analyze.png; '' for none)")
    a.set_defaults(func=run)


def run(args) -> int:
    from . import analyze, format_report, write_json, write_plot

    try:
        scaling = [int(w) for w in args.scaling_workers.split(",") if w.strip()]
    except ValueError:
        print(f"coordl analyze: --scaling-workers should be worker counts like 1,2, but got "
              f"--scaling-workers={args.scaling_workers!r}", file=sys.stderr)
        return 2
    try:
        report = analyze(args.root, dataset=args.dataset, transform=args.transform, batch_size=args.batch_size,
                         workers=args.workers, step=args.step, rate=args.rate, max_samples=args.max_samples,
                         cache=args.cache, evict=args.evict, scaling_workers=scaling,
                         max_workers=args.max_workers, fetch_threads=args.fetch_threads, repeats=args.repeats,
                         step_kind=args.step_kind, device=args.device, model_error=args.model_error, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError, PermissionError) as e:
        print(f"coordl analyze: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.plot:
        why = write_plot(report, args.plot)
        report["plot"] = None if why else args.plot
        report["plot_skipped"] = why
        print(f"plot: {args.plot}" if why is None else f"plot: skipped: {why}")
    if args.json:
        write_json(report, args.json)
        print(f"report: {args.json}")
    return 0
