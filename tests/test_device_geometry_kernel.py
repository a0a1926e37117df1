"""decode="device"'s geometry in a kernel per batch (Triton: the separable,
tiled and per-pixel kernels), run on the CPU by Triton's interpreter: the
same kernels, the same arguments as on a GPU.  Their rows against the
stage's one launch per image (``DecodeStage._geometry``): the crop, the
antialiased resize up and down, the padded second crop, an image laid out
(H, W, 3); then whole passes of the loader with the kernel and without,
batch by batch."""
import importlib.util
import textwrap

import pytest

from coordl.testing import run_in_child

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_ENV = {"TRITON_INTERPRET": "1"}


def _child(body: str, timeout: float = 240):
    import os

    env = dict(os.environ, **_ENV)
    r = run_in_child(textwrap.dedent(body), timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_the_kernels_resize_bicubic_and_a_drawn_mode_as_the_per_image_geometry():
    """Bicubic (torch's antialiased Keys filter, support 2), and a plan
    drawing bilinear or bicubic per sample (each record's MODE, a launch
    per filter): every kernel's rows are the per-image path's within a
    rounding of the floats, and the stage's own checks pass with both modes."""
    out = _child("""
        import numpy as np, torch
        from coordl import transforms as T
        from coordl.device import decode as DD
        from coordl.device import geometry_kernel as GK
        from coordl.device.encoded import plan_for

        rng = np.random.default_rng(4)
        M = T.InterpolationMode
        for modes in ((M.BICUBIC,), (M.BILINEAR, M.BICUBIC)):
            interp = modes if len(modes) > 1 else modes[0]
            plan = plan_for(T.Compose([T.RandomResizedCrop((24, 20), interpolation=interp), T.ToTensor()]))
            stage = DD.DecodeStage(torch.device("cpu"), plan, DD.HostDecoder(), "raise", str)
            imgs, recs = [], []
            for k in range(8):
                H, W = int(rng.integers(6, 64)), int(rng.integers(6, 64))
                h, w = int(rng.integers(1, H + 1)), int(rng.integers(1, W + 1))
                t, l = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
                imgs.append(torch.from_numpy(rng.integers(0, 256, (3, H, W), dtype=np.uint8)))
                recs.append([0, H, W, t, l, h, w, 24, 20, 0, 0, 24, 20, int(k % 3 == 0), k % len(modes), 0, k, 3])
            want = torch.empty((8, 3, 24, 20))
            for j, (img, rec) in enumerate(zip(imgs, recs)):
                stage._geometry(img, rec, into=want[j:j + 1])
            names = tuple(m.value for m in modes)
            items = [(j, a, r) for j, (a, r) in enumerate(zip(imgs, recs))]
            for kind in GK.KINDS:
                got = torch.full_like(want, -7.0)
                GK.BatchGeometry((24, 20), kind, names).run(items, got)
                d = (want - got).abs()
                r = (want.round().clamp(0, 255) - got.round().clamp(0, 255)).abs()
                print("ROW", len(modes), kind, float(d.max()), float(r.max()))
            geo = GK.BatchGeometry((24, 20), "separable", names)
            print("CHECKS", len(modes), GK.agrees(stage, imgs, recs, geo)[0],
                  GK.fused_agrees(geo, torch.device("cpu"), imgs, recs)[0])
            if len(modes) > 1:    # the other filter for every row: far from the per-image path
                wrong = torch.full_like(want, -7.0)
                GK.BatchGeometry((24, 20), "separable", ("bilinear",)).run(items, wrong)
                print("WRONG", float((want - wrong).abs().max()))
    """)
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("ROW ")]
    assert len(rows) == 6, out
    for _, _, float_diff, levels in rows:
        assert float(float_diff) < 1e-3 and float(levels) <= 1, rows
    assert [line for line in out.splitlines() if line.startswith("CHECKS ")] == ["CHECKS 1 True True",
                                                                                "CHECKS 2 True True"], out
    wrong = [float(line.split()[1]) for line in out.splitlines() if line.startswith("WRONG ")]
    assert wrong and wrong[0] > 2, out


def test_the_kernels_rows_are_the_per_image_geometrys():
    out = _child("""
        import numpy as np, torch
        from coordl import transforms as T
        from coordl.device import decode as DD
        from coordl.device import geometry_kernel as GK
        from coordl.device.encoded import plan_for

        rng = np.random.default_rng(3)

        def rows(plan, make, n=10, hwc=False):
            stage = DD.DecodeStage(torch.device("cpu"), plan, DD.HostDecoder(), "raise", str)
            oh, ow = plan.size
            imgs, recs = [], []
            for k in range(n):
                H, W = int(rng.integers(6, 64)), int(rng.integers(6, 64))
                if hwc and k % 2:
                    img = torch.from_numpy(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)).permute(2, 0, 1)
                else:
                    img = torch.from_numpy(rng.integers(0, 256, (3, H, W), dtype=np.uint8))
                imgs.append(img)
                recs.append(make(H, W, k))
            want = torch.empty((n, 3, oh, ow))
            got = torch.full_like(want, -7.0)
            for j, (img, rec) in enumerate(zip(imgs, recs)):
                stage._geometry(img, rec, into=want[j:j + 1])
            items = [(j, a, r) for j, (a, r) in enumerate(zip(imgs, recs))]
            for kind in GK.KINDS:
                got = torch.full_like(want, -7.0)
                GK.BatchGeometry((oh, ow), kind).run(items, got)
                d = (want - got).abs()
                r = (want.round().clamp(0, 255) - got.round().clamp(0, 255)).abs()
                print("ROW", float(d.max()), float(r.max()), float((r > 0).float().mean()))
            # the tiled kernel's final rows: its float rows rounded half to even, clamped and mirrored by torch
            flips = [bool(k % 3 == 0) for k in range(n)]
            recs2 = [list(rec) for rec in recs]
            for rec, f in zip(recs2, flips):
                rec[13] = int(f)
            items = [(j, a, r) for j, (a, r) in enumerate(zip(imgs, recs2))]
            geo = GK.BatchGeometry((oh, ow))
            rows_ = torch.full_like(want, -7.0)
            geo.run(items, rows_)
            fin = torch.zeros((n, 3, oh, ow), dtype=torch.uint8)
            geo.run(items, fin, final=True)
            ref = rows_.round().clamp(0, 255).to(torch.uint8)
            for j, f in enumerate(flips):
                if f:
                    ref[j] = ref[j].flip(-1)
            # the separable kernel's rows are the tiled kernel's: the same products, added in the same order
            tiled = torch.full_like(want, -7.0)
            GK.BatchGeometry((oh, ow), "tiled").run(items, tiled)
            print("SAME", bool(torch.equal(rows_, tiled)))
            print("FINAL", bool(torch.equal(fin, ref)), bool(torch.equal(fin, GK.finished(rows_, flips))))

        def rrc(H, W, k):      # down and up
            h, w = int(rng.integers(1, H + 1)), int(rng.integers(1, W + 1))
            t, l = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
            return [0, H, W, t, l, h, w, 24, 20, 0, 0, 24, 20, 0, 0, 0, k, 3]

        def resize_crop(H, W, k):    # then a second crop, reaching outside where the image is small
            rh, rw = int(rng.integers(8, 50)), int(rng.integers(8, 50))
            return [0, H, W, 0, 0, H, W, rh, rw, (rh - 16) // 2, (rw - 16) // 2, 16, 16, 0, 0, 0, k, 3]

        def crop_only(H, W, k):
            return [0, H, W, 0, 0, H, W, 0, 0, int(rng.integers(-4, 4)), int(rng.integers(-4, 4)), 16, 16,
                    0, 0, 0, k, 3]

        rows(plan_for(T.Compose([T.RandomResizedCrop((24, 20)), T.ToTensor()])), rrc, n=8, hwc=True)
        rows(plan_for(T.Compose([T.Resize((30, 30)), T.CenterCrop(16), T.ToTensor()])), resize_crop, n=6)
        rows(plan_for(T.Compose([T.CenterCrop(16), T.ToTensor()])), crop_only, n=4)

        def far_down(H, W, k):     # spans of tens of pixels: the widest tiles' shapes
            return [0, H, W, 0, 0, H, W, 12, 10, 0, 0, 12, 10, 0, 0, 0, k, 3]

        big = np.random.default_rng(5)
        imgs = [torch.from_numpy(big.integers(0, 256, (3, 330 - 40 * k, 260 + 30 * k), dtype=np.uint8))
                for k in range(2)]
        stage = DD.DecodeStage(torch.device("cpu"), plan_for(T.Compose([T.RandomResizedCrop((12, 10)),
                                                                         T.ToTensor()])),
                               DD.HostDecoder(), "raise", str)
        recs = [far_down(int(a.shape[1]), int(a.shape[2]), k) for k, a in enumerate(imgs)]
        want = torch.empty((2, 3, 12, 10))
        for j, (img, rec) in enumerate(zip(imgs, recs)):
            stage._geometry(img, rec, into=want[j:j + 1])
        for kind in ("separable", "tiled"):
            got = torch.full_like(want, -7.0)
            GK.BatchGeometry((12, 10), kind).run([(j, a, r) for j, (a, r) in enumerate(zip(imgs, recs))], got)
            print("FAR", float((want - got).abs().max()))

        # the separable kernel's row sums over a budget that holds one image's at most: a launch pair per
        # image, the same rows
        items = [(j, a, r) for j, (a, r) in enumerate(zip(imgs, recs))]
        whole = torch.full_like(want, -7.0)
        GK.BatchGeometry((12, 10)).run(items, whole)
        GK.BatchGeometry.MID_BUDGET = 4 * 3 * 330 * 10
        parts = torch.full_like(want, -7.0)
        GK.BatchGeometry((12, 10)).run(items, parts)
        groups = GK._groups(np.array([3 * 330 * 10, 3 * 290 * 10]), 3 * 330 * 10)
        print("GROUPS", groups, bool(torch.equal(whole, parts)))
    """)
    rows = [tuple(map(float, line.split()[1:])) for line in out.splitlines() if line.startswith("ROW ")]
    assert len(rows) == 9, out      # three plans, each through the separable, tiled and per-pixel kernels
    for float_diff, levels, share in rows:
        assert float_diff < 1e-3 and levels <= 1 and share < 0.01, rows
    assert rows[6][0] == rows[7][0] == rows[8][0] == 0          # no resize: the crop's own values
    assert [line for line in out.splitlines() if line.startswith("FINAL ")] == ["FINAL True True"] * 3, out
    assert [line for line in out.splitlines() if line.startswith("SAME ")] == ["SAME True"] * 3, out
    far = [float(x.split()[1]) for x in out.splitlines() if x.startswith("FAR ")]
    assert len(far) == 2 and max(far) < 1e-3, out      # 24-29x down: spans of 64 taps, tiles of 2 rows
    assert "GROUPS [(0, 1), (1, 2)] True" in out, out


@pytest.mark.parametrize("kind", ["separable", "tiled"])
def test_the_kernels_round_half_to_even_in_their_final_rows(kind):
    """Values exactly halfway between two levels (a 2x upscale of a column
    of 2s beside a column of 4s gives 2.5; of 1s beside 3s, 1.5) round to
    the even level in the kernel's final rows, as torch.round does: 2 and
    2, not 3 and 2; and the check the stage runs says the kernel's own
    rounding may be used."""
    out = _child("""
        import numpy as np, torch
        from coordl import transforms as T
        from coordl.device import decode as DD
        from coordl.device import geometry_kernel as GK
        from coordl.device.encoded import plan_for

        img = torch.zeros((3, 4, 2), dtype=torch.uint8)
        img[0, :, 0], img[0, :, 1] = 2, 4
        img[1, :, 0], img[1, :, 1] = 1, 3
        img[2, :, 0], img[2, :, 1] = 5, 7
        rec = [0, 4, 2, 0, 0, 4, 2, 4, 4, 0, 0, 4, 4, 0, 0, 3]
        geo = GK.BatchGeometry((4, 4), KIND)
        rows = torch.zeros((1, 3, 4, 4))
        geo.run([(0, img, rec)], rows)
        fin = torch.zeros((1, 3, 4, 4), dtype=torch.uint8)
        geo.run([(0, img, rec)], fin, final=True)
        print("ROWS", rows[0, :, 0].tolist())
        print("FIN", fin[0, :, 0].tolist())
        print("CHECK", GK.fused_agrees(geo, torch.device("cpu"), [img], [rec])[0], geo.fused)
    """.replace("KIND", repr(kind)))
    rows = eval([x for x in out.splitlines() if x.startswith("ROWS ")][0][5:])
    fin = eval([x for x in out.splitlines() if x.startswith("FIN ")][0][4:])
    # the 2x upscale: weights 3/4 and 1/4 next to the columns' border
    assert rows[0] == [2.0, 2.5, 3.5, 4.0] and rows[1] == [1.0, 1.5, 2.5, 3.0], rows
    assert fin[0] == [2, 2, 4, 4] and fin[1] == [1, 2, 2, 3] and fin[2] == [5, 6, 6, 7], fin
    assert "CHECK True True" in out, out


@pytest.mark.parametrize("kind", ["separable", "tiled"])
def test_the_kernels_tail_is_the_device_tails_arithmetic_bit_for_bit(kind):
    """The kernel's last step, ToTensor's scaling and a Normalize (three
    values, one value, or none), against the device tail run on its uint8
    rows: equal bit for bit; two Normalizes are left to the tail."""
    out = _child("""
        import numpy as np, torch
        from coordl import transforms as T
        from coordl.device import geometry_kernel as GK
        from coordl.device.split import DeviceTail

        rng = np.random.default_rng(9)
        imgs, recs = [], []
        for k in range(5):
            H, W = int(rng.integers(18, 44)), int(rng.integers(18, 44))
            imgs.append(torch.from_numpy(rng.integers(0, 256, (3, H, W), dtype=np.uint8)))
            recs.append([0, H, W, 0, 0, H, W, 17, 19, 0, 0, 17, 19, k % 2, 0, 0, k, 3])
        items = [(j, a, r) for j, (a, r) in enumerate(zip(imgs, recs))]
        geo = GK.BatchGeometry((17, 19), KIND)
        u8 = torch.zeros((5, 3, 17, 19), dtype=torch.uint8)
        geo.run(items, u8, final=True)
        for name, norms in [("three", [T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]),
                            ("one", [T.Normalize([0.5], [0.3])]), ("none", []),
                            ("two", [T.Normalize([0.1, 0.2, 0.3], [0.5, 0.6, 0.7]), T.Normalize([1.0], [2.0])])]:
            tail = DeviceTail(norms)
            if not GK.tail_fits(tail):
                print("TAIL", name, "unfit")
                continue
            got = torch.full((5, 3, 17, 19), -7.0)
            geo.run(items, got, final=True, tail=tail)
            print("TAIL", name, bool(torch.equal(got, tail(u8))))
        ok, what = GK.fused_agrees(geo, torch.device("cpu"), imgs, recs, DeviceTail(norms[:1]))
        print("CHECK", ok, geo.fused, geo.fused_tail)
    """.replace("KIND", repr(kind)))
    lines = [x for x in out.splitlines() if x.startswith(("TAIL ", "CHECK "))]
    assert lines == ["TAIL three True", "TAIL one True", "TAIL none True", "TAIL two unfit",
                     "CHECK True True True"], out


def test_passes_with_the_kernel_are_within_a_level_of_one_launch_per_image(tmp_path):
    from coordl.synth import make_image_folder

    import os

    import numpy as np
    from PIL import Image

    root = make_image_folder(str(tmp_path / "p"), num_images=12, num_classes=2, mean_kb=4, image_size=(60, 44),
                             seed=2)
    # a PNG among the JPEGs: the CPU path's in the worker, so its batch has a row the kernel does not make
    sub = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))[0]
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(
        os.path.join(root, sub, "zz_png.jpg"), "PNG")
    out = _child(f"""
        import os, torch
        import coordl
        from coordl import transforms as T
        from coordl.device import decode as DD, delivery as D

        from coordl.device import geometry_kernel as GK

        D.CPU_TEST_DEVICE = True
        DD.BATCH_GEOMETRY_ON_CPU = True
        launches = []
        real = GK.BatchGeometry.run

        def run_counted(self, items, y, final=False, tail=None):
            launches.append((len(items), ("tail" if tail is not None else True) if final else False, self.kind))
            return real(self, items, y, final, tail)

        GK.BatchGeometry.run = run_counted
        from coordl.device.encoded import KIND, ON_CPU
        ready = []      # per batch, the rows the worker prepared on the CPU path
        real_finish = DD.DecodeStage.finish

        def finish_noted(self, pending):
            ready.append([j for j, r in enumerate(pending.keep) if pending.records[0][r][KIND] == ON_CPU])
            return real_finish(self, pending)

        DD.DecodeStage.finish = finish_noted
        tf = T.Compose([T.RandomResizedCrop(20), T.RandomHorizontalFlip(), T.ToTensor(),
                        T.Normalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3])])
        ds = coordl.ImageFolder({root!r}, tf)

        def run(mode):
            os.environ["COORDL_DEVICE_GEOMETRY"] = mode
            L = coordl.DataLoader(ds, batch_size=5, seed=4, shuffle=True, device="cpu", decode="device",
                                  num_workers=1)
            del launches[:], ready[:]
            got = list(L)
            return got, list(launches)

        # the worker prepares a third of the samples on the CPU path besides the PNG
        os.environ["COORDL_DEVICE_DECODER"] = "torchvision:2+workers:1"
        kern, used = run("auto")
        rows = list(ready)
        per, unused = run("per-image")
        # the first batch's probe runs the separable kernel four times on its few images (against the
        # per-image rows, then its float rows against its own rounding and mirror, and those against its
        # own ToTensor/Normalize); then every batch is one launch that writes the final float rows
        print("LAUNCHES", sum(n for n, _, _ in used), len(used), len(unused))
        print("FINAL", [f for _, f, _ in used], all(t == "separable" for _, _, t in used))
        std = torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1) * 255
        worst = 0.0
        for (a, y), (b, y2), cpu in zip(kern, per, rows):
            assert torch.equal(y, y2)
            worst = max(worst, float(((a - b).abs() * std).max()))
            # the CPU path's rows are the same values whichever path finished the batch
            assert torch.equal(a[cpu], b[cpu]), cpu
        print("WORST", worst, len(kern))
        print("READY", [len(r) for r in rows], sum(map(len, rows)))
    """)
    line = [x for x in out.splitlines() if x.startswith("WORST ")]
    assert line, out
    worst, n = float(line[0].split()[1]), int(line[0].split()[2])
    assert n == 3 and worst <= 1.001, out      # 13 samples, batches of 5
    images, calls, per_image_calls = map(int, [x for x in out.splitlines() if x.startswith("LAUNCHES ")][0].split()[1:])
    per_batch, total = [x for x in out.splitlines() if x.startswith("READY ")][0][6:].rsplit(" ", 1)
    per_batch, total = eval(per_batch), int(total)
    # the kernel makes every row but the CPU path's: the first batch's in its probe's 4 launches too
    assert calls == 7 and images == 4 * (5 - per_batch[0]) + 13 - total and per_image_calls == 0, out
    # every batch is rounded, mirrored and normalized by the kernel, to the end, the rows the worker
    # prepared on the CPU path (the PNG's and the workers' share) put in beside the kernel's
    final = eval([x for x in out.splitlines() if x.startswith("FINAL ")][0][6:].rsplit("]", 1)[0] + "]")
    assert final[:4] == [False, False, True, "tail"] and final[4:] == ["tail"] * 3, out
    assert total >= 3 and any(0 < n < 5 for n in per_batch), out     # batches with rows of both
    assert [x for x in out.splitlines() if x.startswith("FINAL ")][0].endswith("] True"), out   # all separable


def test_a_pass_drawing_its_mode_uses_the_kernel_within_a_level_of_one_launch_per_image(tmp_path):
    """timm's random interpolation through the loader: the stage's check
    (both modes on the first batch's images) takes the kernel, which runs a
    launch per filter, and the batches are the per-image path's within a
    level."""
    from coordl.synth import make_image_folder

    root = make_image_folder(str(tmp_path / "p"), num_images=10, num_classes=2, mean_kb=4, image_size=(60, 44),
                             seed=3)
    out = _child(f"""
        import os, torch
        import coordl
        from coordl import transforms as T
        from coordl.device import decode as DD, delivery as D
        from coordl.device import geometry_kernel as GK

        D.CPU_TEST_DEVICE = True
        DD.BATCH_GEOMETRY_ON_CPU = True
        used = []
        real = GK.BatchGeometry._run

        def counted(self, items, y, final, tail, cubic):
            used.append(cubic)
            return real(self, items, y, final, tail, cubic)

        GK.BatchGeometry._run = counted
        M = T.InterpolationMode
        tf = T.Compose([T.RandomResizedCrop(18, interpolation=(M.BILINEAR, M.BICUBIC)), T.RandomHorizontalFlip(),
                        T.PILToTensor()])
        ds = coordl.ImageFolder({root!r}, tf)

        def run(mode):
            os.environ["COORDL_DEVICE_GEOMETRY"] = mode
            del used[:]
            return list(coordl.DataLoader(ds, batch_size=5, seed=2, device="cpu", decode="device")), list(used)

        kern, launches = run("auto")
        per, none = run("per-image")
        worst = max(float((a.int() - b.int()).abs().max()) for (a, _), (b, _) in zip(kern, per))
        print("RESULT", worst, sorted(set(launches)), len(none), len(kern))
    """)
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert line, out
    worst, rest = line[0].split(" ", 2)[1:]
    assert float(worst) <= 1 and rest == "[False, True] 0 2", out    # both filters launched; none per image


def test_with_colorjitter_the_kernel_writes_uint8_rows_and_the_jitter_follows(tmp_path):
    """A plan with torchvision's ColorJitter: the kernel writes the batch's
    uint8 rows (not the tail's floats), the device's jitter runs on them (in
    its own kernel), then the tail; bit for bit the CPU's jitter of the
    kernel's rows with each sample's draws."""
    import os

    from coordl.synth import make_image_folder

    root = make_image_folder(str(tmp_path / "p"), num_images=10, num_classes=2, mean_kb=4, image_size=(60, 44),
                             seed=3)
    out = _child(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from _torchvision import import_torchvision
        if import_torchvision() is None:
            print("NO-TORCHVISION")
            raise SystemExit(0)
        from torchvision import datasets, transforms as V
        import coordl
        from coordl import _rng
        from coordl.decode import color as C, jpeg
        from coordl.device import decode as DD, delivery as D, geometry_kernel as GK
        from coordl.device.encoded import plan_for

        from coordl.device import jitter as J

        D.CPU_TEST_DEVICE = True
        DD.BATCH_GEOMETRY_ON_CPU = True
        J.KERNEL_ON_CPU = True              # the jitter's kernel too
        finals = []
        real = GK.BatchGeometry.run

        def run_counted(self, items, y, final=False, tail=None):
            finals.append(("tail" if tail is not None else True) if final else False)
            return real(self, items, y, final, tail)

        GK.BatchGeometry.run = run_counted
        geo = [V.RandomResizedCrop(20), V.RandomHorizontalFlip()]
        norm = V.Normalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3])
        kw = dict(batch_size=5, seed=4, shuffle=False, device="cpu", decode="device", num_workers=1)

        def run(tf):
            del finals[:]
            L = coordl.DataLoader(datasets.ImageFolder({root!r}, transform=V.Compose(tf)), **kw)
            return list(L), list(finals), L
        jit, f_jit, L = run(geo + [V.ColorJitter(0.4, 0.4, 0.4, 0.1), V.PILToTensor()])
        plain, f_plain, _ = run(geo + [V.PILToTensor()])
        _, f_norm, _ = run(geo + [V.ColorJitter(0.4, 0.4, 0.4, 0.1), V.ToTensor(), norm])
        _, f_norm_plain, _ = run(geo + [V.ToTensor(), norm])
        plan, ds = plan_for(L.dataset.transform), L.dataset
        i = same = 0
        for (a, y), (b, y2) in zip(jit, plain):
            assert torch.equal(y, y2)
            for r in range(len(y)):
                g = _rng.derive(4, 0, i)
                plan.draw(*jpeg.jpeg_size(ds.raw(i)), g)
                same += torch.equal(a[r], torch.from_numpy(C.jitter(b[r].numpy(), plan.draw_ops(g))))
                i += 1
        print("SAME", same, i)
        print("JITTER", sorted(L._decode_stage.jitter._kernel_ok.items()), sorted(L._decode_stage.jitter._exact))
        print("FINALS", f_jit[3:], f_plain[3:], f_norm[4:], f_norm_plain[4:])
    """)
    if "NO-TORCHVISION" in out:
        pytest.skip("torchvision is not installed")
    assert [x for x in out.splitlines() if x.startswith("SAME ")] == ["SAME 10 10"], out
    # the jitter ran in its kernel, every kind of it checked first; torch's operations never ran
    assert "JITTER [(0, True), (1, True), (2, True)] []" in out, out
    finals = [x for x in out.splitlines() if x.startswith("FINALS ")][0]
    # after each probe's launches: one launch per batch, uint8 rows where a jitter follows, the
    # tail's floats where nothing does
    assert finals == "FINALS [True, True] [True, True] [True, True] ['tail', 'tail']", out
