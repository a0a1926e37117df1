"""Which JPEG decoder for ``decode="device"``: images/s, CPU per image and
distance from the CPU path's pixels, for every decoder and backend at hand.

``decode="device"`` is bound, on a GPU, by its decode thread: torchvision's
batched nvJPEG call (the hardware JPEG decoder for baseline JPEGs where the
GPU has one) keeps about one core busy, most of it, under CUDA's default
scheduling, spinning in the stream synchronize that ends each call, and
holds a process-wide lock (docs/benchmarks.md section 8).  nvImageCodec
can choose its backend: the A100/H100/H200 hardware JPEG decoder
(``HW_GPU_ONLY``), CUDA decoding (``GPU_ONLY``), the hybrid one, the CPU;
with or without libjpeg's interpolated ("fancy") chroma upsampling; from
several threads, each with a decoder of its own.  This measures each
variant on the same files in the same process:

* images/s: batches of ``--batch`` decoded for ``--seconds`` seconds
  (device synchronized at both ends), with 1 and 2 threads (``--threads``);
* CPU ms per image: the process's CPU time over the same window (every
  thread, the decoder's own included; a thread waiting for the GPU spins
  under CUDA's default scheduling: the ``blocking waits`` variants measure
  the same decoder with ``COORDL_CUDA_WAIT=block``'s setting);
* pixels: max and mean absolute difference per channel value over the
  first ``--check`` images, against libjpeg-turbo's full decode with fancy
  upsampling (PIL: what the CPU path decodes) and with plain upsampling
  (simplejpeg ``fastupsample``); images the variant could not decode are
  counted.

With no GPU (CI), the CPU variants run (PIL, simplejpeg, nvImageCodec's CPU
backend where installed) and the rest say why they were skipped.

    python benchmarks/device_decoders.py --device cuda --json decoders.json
    python benchmarks/device_decoders.py --quick            # tiny smoke run (tests use it)
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402


# ---------------------------------------------------------------- variants
class _PIL:
    name = "PIL (CPU path's decode)"
    device = "cpu"

    @staticmethod
    def inputs(blobs):
        """The files in the form the decoder takes, made once, outside the timed window."""
        return blobs

    def __init__(self, device):
        from PIL import Image
        self._img = Image

    def decode(self, blobs):
        return [np.asarray(self._img.open(io.BytesIO(b)).convert("RGB")) for b in blobs]


class _SimpleJpeg:
    name = "simplejpeg, plain upsampling (CPU stand-in)"
    device = "cpu"
    inputs = _PIL.inputs

    def __init__(self, device):
        import simplejpeg
        self._sj = simplejpeg

    def decode(self, blobs):
        return [self._sj.decode_jpeg(b, colorspace="RGB", fastupsample=True) for b in blobs]


class _Torchvision:
    name = "torchvision.io.decode_jpeg batched (nvJPEG)"
    chw = True              # its images are (3, H, W); the references (H, W, 3)

    def __init__(self, device):
        if device.type != "cuda":
            raise RuntimeError("needs a CUDA device")
        from torchvision.io import ImageReadMode, decode_jpeg
        self.device, self._decode, self._mode = device, decode_jpeg, ImageReadMode.RGB

    @staticmethod
    def inputs(blobs):
        return [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]

    def decode(self, data):
        return list(self._decode(data, mode=self._mode, device=self.device))


def _blocking(cls):
    """``cls`` measured with the device's host waits set to blocking
    synchronization (``COORDL_CUDA_WAIT=block``; set before the variant and
    restored after it): the CPU its waits cost when they do not spin."""

    class _Blocking(cls):
        name = cls.name + ", blocking waits"
        wait = "block"

    return _Blocking


def _nvimgcodec(label: str, kind, fancy: bool, cpu_threads: int = 0):
    """An nvImageCodec variant: backend ``kind`` (a BackendKind name, or a
    tuple of them in order, each a name or (name, load hint): the fraction
    of each batch that backend takes, as DALI's ``hw_decoder_load``; None:
    every backend, the library's choice); ``fancy``: True asks for libjpeg's
    interpolated chroma upsampling, ``"plain"`` for plain upsampling, False
    leaves the library's default."""

    class _Nv:
        name = f"nvImageCodec {label}" + {True: ", fancy upsampling", "plain": ", plain upsampling"}.get(fancy, "") + \
            (f", {cpu_threads} CPU threads" if cpu_threads else "")

        def __init__(self, device):
            from nvidia import nvimgcodec as nv
            cpu = kind == "CPU_ONLY"
            if device.type != "cuda" and not cpu:
                raise RuntimeError("needs a CUDA device")
            if cpu and device.type == "cuda":
                raise RuntimeError("measured on --device cpu")
            self.device, self._cpu, self._nv = device, cpu, nv
            kw = {"options": {True: ":fancy_upsampling=1", "plain": ":fancy_upsampling=0"}.get(fancy, "")}
            if kind is not None:
                kinds = (kind,) if isinstance(kind, str) else kind
                kw["backends"] = [nv.Backend(getattr(nv.BackendKind, k)) if isinstance(k, str) else
                                  nv.Backend(getattr(nv.BackendKind, k[0]), load_hint=k[1]) for k in kinds]
            if cpu_threads:
                kw["max_num_cpu_threads"] = cpu_threads
            dev = nv.NVIMGCODEC_DEVICE_CPU_ONLY if cpu else (device.index or 0)
            self._dec = nv.Decoder(device_id=dev, **kw)
            from coordl.device.decoders import _rgb_params
            self._params = _rgb_params(nv)

        @staticmethod
        def inputs(blobs):
            return [np.frombuffer(b, dtype=np.uint8) for b in blobs]

        def decode(self, arrays):
            kw = {} if self._cpu else {"cuda_stream": torch.cuda.current_stream(self.device).cuda_stream}
            images = self._dec.decode(arrays, params=self._params, **kw)
            out = []
            for img in images:
                if img is None:
                    out.append(None)
                elif self._cpu:
                    out.append(np.asarray(img))
                else:
                    out.append(torch.as_tensor(img, device=self.device))
            return out

    return _Nv


HW_FIRST = ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU")

# the most telling first: the check gives this script a time limit, and what is cut is the tail
VARIANTS = [
    _PIL, _SimpleJpeg, _Torchvision,
    _blocking(_Torchvision),
    _nvimgcodec("hardware decoder first, then CUDA and hybrid (nvimgcodec-hw)", HW_FIRST, False),
    _blocking(_nvimgcodec("hardware decoder first, then CUDA and hybrid (nvimgcodec-hw)", HW_FIRST, False)),
    # CUDA decoding asked for plain chroma upsampling, as COORDL_DEVICE_DECODER=nvimgcodec-cuda asks (with
    # libjpeg's interpolation the third H200 run's CUDA decoder decoded none of these files)
    _nvimgcodec("CUDA decoder", "GPU_ONLY", "plain"),
    # DALI's mixed decoder: the hardware decoder takes a fixed share of each batch, the hybrid
    # decoder (Huffman in CPU threads) the rest, at once
    _nvimgcodec("hardware decoder 65%, hybrid the rest", (("HW_GPU_ONLY", 0.65), "HYBRID_CPU_GPU"), False,
                cpu_threads=15),
    _nvimgcodec("hardware decoder 80%, hybrid the rest", (("HW_GPU_ONLY", 0.8), "HYBRID_CPU_GPU"), False,
                cpu_threads=8),
    _nvimgcodec("hybrid, then CUDA (nvimgcodec-hybrid)", ("HYBRID_CPU_GPU", "GPU_ONLY"), False),
    _nvimgcodec("(its own choice)", None, True),
    _nvimgcodec("hardware decoder", "HW_GPU_ONLY", False),
    _nvimgcodec("CUDA decoder", "GPU_ONLY", True),
    _nvimgcodec("(its own choice)", None, True, cpu_threads=2),
    _nvimgcodec("CPU backend", "CPU_ONLY", True),
]


# ---------------------------------------------------------------- measuring
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host(img, chw: bool = False) -> np.ndarray | None:
    """A decoded image on the host as (H, W, C), as the references are."""
    if img is None:
        return None
    if isinstance(img, torch.Tensor):
        img = img.cpu()
        return (img.permute(1, 2, 0) if chw else img).numpy()
    a = np.asarray(img)
    return a.transpose(1, 2, 0) if chw else a


def throughput(cls, device, blobs: list, batch: int, seconds: float, threads: int) -> dict:
    """Images/s and process CPU ms per image, ``threads`` threads each with
    a decoder of its own decoding whole batches for ``seconds``.  Only the
    images decoded count: a backend that returns None for an image it
    cannot take is fast at it, and its row says how many it left."""
    decoders = [cls(device) for _ in range(threads)]
    data = cls.inputs(blobs)
    batches = [data[k:k + batch] for k in range(0, len(data), batch)] or [data]
    for d in decoders:                       # warm-up: first-call allocations, handles
        d.decode(batches[0])
    _sync(device)
    counts = [0] * threads
    missed = [0] * threads
    stop = time.perf_counter() + seconds
    errors: list = []

    def run(t):
        try:
            k = t
            while True:          # at least one batch, however late the thread starts
                out = decoders[t].decode(batches[k % len(batches)])
                done = sum(x is not None for x in out)
                counts[t] += done
                missed[t] += len(out) - done
                k += 1
                if time.perf_counter() >= stop:
                    break
            _sync(device)
        except BaseException as e:  # noqa: BLE001 - reported in the row
            errors.append(f"{type(e).__name__}: {e}")

    c0, t0 = time.process_time(), time.perf_counter()
    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    _sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(counts)
    if errors:
        return {"error": errors[0][:500]}
    if not n:
        return {"error": f"no image decoded ({sum(missed)} returned empty)"}
    return {"images_per_s": round(n / wall, 1), "cpu_ms_per_image": round(cpu / max(n, 1) * 1e3, 4),
            "cores_busy": round(cpu / wall, 2), "images": n, "undecoded": sum(missed)}


def fidelity(cls, device, blobs: list, refs: dict) -> dict:
    """Per reference: max and mean absolute difference per channel value
    over the images compared; images it could not decode, or decoded to
    another shape (not compared)."""
    chw = getattr(cls, "chw", False)
    got = [_host(x, chw) for x in cls(device).decode(cls.inputs(blobs))]
    _sync(device)
    out = {"undecoded": sum(g is None for g in got)}
    for rname, ref in refs.items():
        mx, tot, cnt, shape = 0, 0.0, 0, 0
        for g, r in zip(got, ref):
            if g is None:
                continue
            if g.shape != r.shape:
                shape += 1
                continue
            d = np.abs(g.astype(np.int16) - r.astype(np.int16))
            mx, tot, cnt = max(mx, int(d.max())), tot + float(d.sum()), cnt + d.size
        compared = sum(g is not None for g in got) - shape
        out[rname] = {"max": mx, "mean": round(tot / max(cnt, 1), 4), "other_shape": shape, "compared": compared}
    return out


def _scheduling(device) -> str:
    try:
        from coordl.device import waits
        torch.zeros(1, device=device)          # the primary context exists: its flags are the ones in use
        return waits.scheduling(device.index or 0)
    except Exception as e:  # noqa: BLE001 - reported, not needed
        return f"unknown ({type(e).__name__}: {e})"


def make_files(n: int, size, tmp: str) -> list:
    from coordl.synth import make_image_folder
    root = make_image_folder(os.path.join(tmp, "photos"), num_images=n, num_classes=4, image_size=size,
                             seed=11, workers=4)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".jpg"))
    return [open(f, "rb").read() for f in files]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    ap.add_argument("--images", type=int, default=512, help="synthetic ImageNet-like JPEGs (~110 KB, ~400x350)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--check", type=int, default=64, help="images compared with the CPU decodes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.batch, args.seconds, args.check = 12, 4, 0.1, 4
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="coordl-decoders-") as tmp:
        blobs = make_files(args.images, (64, 48) if args.quick else None, tmp)
    print(f"{len(blobs)} JPEGs, {sum(map(len, blobs)) / len(blobs) / 1024:.1f} KB mean; batch {args.batch}; "
          f"{args.seconds:g} s windows; device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f"; {os.cpu_count()} CPUs; torch {torch.__version__}"
          + (f"; the device's host waits: {_scheduling(device)}" if device.type == "cuda" else ""), flush=True)
    import simplejpeg
    from PIL import Image
    check = blobs[:args.check]
    refs = {"libjpeg fancy (PIL)": [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in check],
            "libjpeg plain": [simplejpeg.decode_jpeg(b, colorspace="RGB", fastupsample=True) for b in check]}
    rows = {}

    def save() -> None:   # after every variant: a run cut by the check's time limit keeps what it measured
        if args.json:
            from common import write_json

            write_json(args.json, {"device": str(device), "images": len(blobs), "batch": args.batch,
                                   "seconds": args.seconds, "threads": threads, "rows": rows})

    for cls in VARIANTS:
        row = rows[cls.name] = {}
        try:
            cls(device)
        except Exception as e:  # noqa: BLE001 - not here: said, the others go on
            row["skipped"] = f"{type(e).__name__}: {e}"[:300]
            print(f"  {cls.name}: skipped: {row['skipped']}", flush=True)
            save()
            continue
        wait, before = getattr(cls, "wait", None), None
        try:
            if wait:
                from coordl.device import waits
                before = waits.set_scheduling(device.index or 0, wait)
                row["waits"] = f"{wait} (were {before})"
            row["pixels"] = fidelity(cls, device, check, refs)
            for t in threads:
                row[f"{t} threads"] = throughput(cls, device, blobs, args.batch, args.seconds, t)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            if before is not None:
                waits.set_scheduling(device.index or 0, before)
        cells = []
        for t in threads:
            r = row.get(f"{t} threads", {})
            cells.append(f"{t} thr: {r['images_per_s']:>9,.0f} img/s {r['cpu_ms_per_image']:.3f} CPU ms/img"
                         + (f" ({r['undecoded']:,} undecoded)" if r.get("undecoded") else "")
                         if "images_per_s" in r else f"{t} thr: {r.get('error', row.get('error', '-'))[:80]}")
        px = row.get("pixels", {})
        fid = " | ".join((f"vs {k}: max {v['max']} mean {v['mean']:.3f}" if v.get("compared", 1) else
                          f"vs {k}: none compared ({v.get('other_shape', 0)} of another shape)")
                         for k, v in px.items() if isinstance(v, dict))
        print(f"  {cls.name}\n      " + "; ".join(cells) + f"\n      {fid}; undecoded {px.get('undecoded', '-')}",
              flush=True)
        save()
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
