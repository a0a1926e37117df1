"""``coordl`` command line: ``coordl demo``, ``coordl cache``, ``coordl daemon``, ``coordl analyze``,
``coordl verify``, ``coordl version``."""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _cmd_demo(args) -> int:
    from .demo import DemoRootError, run_demo

    try:
        out = run_demo(root=args.root, images=args.images, epochs=args.epochs,
                       workers=args.workers, batch_size=args.batch_size)
    except DemoRootError as e:   # a --root it will not use: nothing was written
        print(f"coordl demo: {e}", file=sys.stderr)
        return 2
    return 0 if out["resume_exact"] else 1   # the demo's own check failed: say so to the shell


def _cmd_cache(args) -> int:
    from .cache import CacheSecurityError

    try:
        return _cache(args)
    except (CacheSecurityError, TimeoutError) as e:
        print(f"coordl cache {args.cache_cmd}: {e}", file=sys.stderr)
        return 1


def _cache(args) -> int:
    from .cache import clear_caches, list_caches, user_dir

    if args.cache_cmd == "clear":
        removed = clear_caches(args.name, force=args.force)
        for name in removed:
            print(f"removed {name}")
        busy = [c.name for c in list_caches() if args.name in (None, c.name) and c.in_use]
        for name in busy:
            print(f"kept {name}: in use (pass --force to remove it anyway; its users keep their memory "
                  "until they exit)")
        if args.name and not removed and not busy:
            print(f"no cache named {args.name} in {user_dir()}")
            return 1
        return 0
    caches = list_caches()
    if not caches:
        print(f"no coordl caches in {user_dir()}")
        return 0
    print(f"caches in {user_dir()}:")
    print(f"{'name':<48}{'size':>10}{'filled':>10}{'samples':>16}{'hits':>10}{'misses':>10}  holders")
    for c in caches:
        who = str(c.holders) if c.holders > 0 else ("in use" if c.in_use else "idle")
        print(f"{c.name:<48}{c.capacity / 2**20:>9.1f}M{c.filled / 2**20:>9.1f}M"
              f"{f'{c.cached}/{c.samples}':>16}{c.hits:>10}{c.misses:>10}  "
              f"{who}{' (full)' if c.full else ''}")
        if c.peer_in or c.peer_out:
            print(f"{'':<4}peers: got {c.peer_in} samples ({c.peer_in_bytes / 2**20:.1f}M) from other nodes, "
                  f"served {c.peer_out} ({c.peer_out_bytes / 2**20:.1f}M) to them")
    return 0


def _cmd_daemon(args) -> int:
    from .daemon import server

    try:
        if args.daemon_cmd == "start":
            if args.staging:
                import os

                os.environ["COORDL_STAGING"] = args.staging  # the daemon reads it when it starts
            pid = server.start()
            print(f"coordl daemon running, pid {pid}, socket {server.socket_path()}")
            return 0
        if args.daemon_cmd == "stop":
            print("coordl daemon stopped" if server.stop() else "no coordl daemon was running")
            return 0
        st = server.status()
    except (OSError, RuntimeError) as e:
        print(f"coordl daemon {args.daemon_cmd}: {e}", file=sys.stderr)
        return 1
    if args.json:
        import json

        print(json.dumps(st, indent=1))
        return 0 if st is not None else 1
    if st is None:
        print(f"no coordl daemon running (socket {server.socket_name()})")
        return 1
    print(format_status(st))
    return 0


def format_status(st: dict) -> str:
    """``coordl daemon status`` as text."""
    mib = 2 ** 20
    out = [f"coordl daemon pid {st['pid']}, up {st['uptime']:.0f} s, workers "
           f"{len(st.get('worker_pids', []))} (pids {' '.join(map(str, st.get('worker_pids', []))) or '-'}), "
           f"staging limit {st.get('staging_limit', 0) / mib:.0f} MiB per group"]
    for p in st.get("pools", []):
        if p.get("groups"):
            ws = p.get("workers", [])
            retiring = sum(1 for w in ws if w.get("retiring"))
            out.append(f"pool of group(s) {' '.join(map(str, p['groups']))}: {len(ws) - retiring} worker(s)"
                       f"{f' (+{retiring} retiring)' if retiring else ''}, the members brought {p.get('brought')}"
                       f" (at most {st.get('max_workers')} for all pools)")
    groups = st.get("groups", [])
    if not groups:
        out.append("no groups")
    for g in groups:
        out.append(f"group {g['id']} ({g['key']}): {len(g['members'])} member(s), prepared {g['prepared']}, "
                   f"staging {g['staged_bytes'] / mib:.1f}/{g['staging_bytes'] / mib:.1f} MiB "
                   f"({g['staged']} staged, {g['preparing']} preparing, {g['slots']} slots), "
                   f"detaches {g['detaches']}{'  BROKEN: ' + g['broken'] if g.get('broken') else ''}")
        out.append(f"  dataset: {g['dataset'].splitlines()[0] if g['dataset'] else '?'}")
        out.append(f"  {'pid':>8} {'state':<9} {'epoch':>5} {'position':>9} {'lag':>6} {'shared':>9} "
                   f"{'self':>8}  name")
        for m in g["members"]:
            state = "shared" if m["attached"] else "own-prep" if m["epoch"] >= 0 else "joined"
            lag = "-" if m["lag"] is None else str(m["lag"])
            out.append(f"  {m['pid']:>8} {state:<9} {m['epoch']:>5} {m['position']:>9} {lag:>6} "
                       f"{m['shared']:>9} {m['self']:>8}  {m['name']}")
    cache = st.get("caches")
    if cache:
        out.append("node caches:")
        for c in cache:
            out.append(f"  {c['name']}: {c['filled'] / mib:.1f}/{c['capacity'] / mib:.1f} MiB, "
                       f"{c['cached']}/{c['samples']} samples, {c['holders']} holder(s)")
    for p in st.get("peer_servers") or []:
        out.append(f"serving {p['cache']} to other nodes on {p['address'][0]}:{p['address'][1]} for pid "
                   f"{p['job_pid']}: {p['connections']} connection(s), {p['samples_served']} samples "
                   f"({p['bytes_served'] / mib:.1f} MiB) served, {p['absent']} absent")
    return "\n".join(out)


def _cmd_version(args) -> int:
    from . import __version__

    print(__version__)
    return 0


def _cmd_verify(args) -> int:
    from .decode.verify import damaged_jpegs

    found = 0
    for path, why in damaged_jpegs(args.paths, threads=args.threads):
        print(f"{path}: {why}")
        found += 1
    print(f"coordl verify: {found} damaged JPEG file{'s' if found != 1 else ''}", file=sys.stderr)
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coordl", description="coordl data loader tools")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="generate a small photo-like ImageFolder and compare coordl with torch's DataLoader")
    d.add_argument("--root", default=None, help="a new or empty directory to generate the dataset in, kept "
                                                "afterwards; a directory an earlier demo generated is reused "
                                                "(default: a temporary directory, removed afterwards)")
    d.add_argument("--images", type=int, default=None, help="number of images (default 600; with a --root an "
                                                             "earlier demo made: what it holds)")
    d.add_argument("--epochs", type=int, default=2, help="epochs per loader (default 2)")
    d.add_argument("--workers", type=int, default=2, help="worker processes per loader (default 2)")
    d.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    d.set_defaults(func=_cmd_demo)

    from .cache import user_dir

    where = os.path.join(user_dir(), "cache-*")   # where this environment's caches are (COORDL_SHM_DIR)
    c = sub.add_parser("cache", help=f"show or remove your node caches ({where})",
                       description=f"Your node caches on this node: {where} (the directory is "
                                   "$COORDL_SHM_DIR, or /dev/shm when it is unset, then coordl-<uid>).")
    csub = c.add_subparsers(dest="cache_cmd", required=True)
    csub.add_parser("ls", help="list caches: size, fill, samples cached, hits, misses, holders "
                               "(processes attached)")
    cl = csub.add_parser("clear", help="remove caches not in use, kept warm or not (all, or NAME)")
    cl.add_argument("name", nargs="?", default=None)
    cl.add_argument("--force", action="store_true", help="also remove caches in use")
    c.set_defaults(func=_cmd_cache)

    dm = sub.add_parser("daemon", help="the node daemon that prepares samples once for every job "
                                       "with share=True (one per user per node)")
    dsub = dm.add_subparsers(dest="daemon_cmd", required=True)
    ds = dsub.add_parser("start", help="start it detached (jobs with share=True also do, if none runs)")
    ds.add_argument("--staging", default=None, help="staging memory per group, e.g. 512MiB "
                                                    "(default 512MiB, or $COORDL_STAGING)")
    dsub.add_parser("stop", help="stop it; its members go on preparing for themselves")
    dst = dsub.add_parser("status", help="groups, members (pid, name, position, lag, shared vs "
                                         "self-prepared samples), staging and cache use")
    dst.add_argument("--json", action="store_true", help="print the status as JSON")
    dm.set_defaults(func=_cmd_daemon)

    from .analyze.cli import add_parser as add_analyze_parser

    add_analyze_parser(sub)

    vf = sub.add_parser("verify", help="list the JPEG files whose data ends early or is corrupt (a GPU decoder "
                                       "would decode them only in part); exit status 1 when there are any",
                        description="Reads every JPEG's entropy-coded data through libjpeg-turbo, as "
                                    "COORDL_DEVICE_CHECK_DATA=1 has a decode='device' loader's workers do at every "
                                    "epoch, once, and lists the damaged files.")
    vf.add_argument("paths", nargs="+", help="folders (walked) or files")
    vf.add_argument("--threads", type=int, default=None, help="threads reading (default: one per CPU)")
    vf.set_defaults(func=_cmd_verify)

    v = sub.add_parser("version", help="print coordl's version")
    v.set_defaults(func=_cmd_version)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
