"""The recipes people run, with only the DataLoader import changed:
torchvision's reference presets (objects that only apply a Compose they
hold) are read through to that Compose; the steps after an as-written one
that draw no random numbers run without a generator of their own (and as
coordl's conversion on a PIL image)."""
import os
import random
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

tv = import_torchvision()
if tv is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

from torchvision import datasets as D  # noqa: E402
from torchvision import transforms as V1  # noqa: E402
from torchvision.transforms import v2 as V2  # noqa: E402

import coordl  # noqa: E402
from coordl import _rng  # noqa: E402
from coordl import transforms as T  # noqa: E402
from coordl.tvcompat import TorchvisionPipeline, holder_attribute, translate  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def photos(photo_folder):
    return photo_folder("recipes", num_images=24, num_classes=3, mean_kb=3, image_size=(64, 48), seed=3)


# The shape of torchvision's references/classification/presets.py, written here: an object that
# builds a Compose in __init__ and whose __call__ returns self.transforms(img).
class PresetTrain:
    def __init__(self, *, crop_size, policy=None, use_v2=False):
        M = V2 if use_v2 else V1
        ts = [M.RandomResizedCrop(crop_size, antialias=True), M.RandomHorizontalFlip(0.5)]
        if policy == "ra":
            ts.append(M.RandAugment())
        elif policy == "ta_wide":
            ts.append(M.TrivialAugmentWide())
        elif policy == "augmix":
            ts.append(M.AugMix())
        ts.append(M.PILToTensor())
        ts += [M.ToDtype(torch.float, scale=True) if use_v2 else M.ConvertImageDtype(torch.float),
               M.Normalize(mean=MEAN, std=STD)]
        if use_v2:
            ts.append(M.ToPureTensor())
        self.transforms = M.Compose(ts)

    def __call__(self, img):
        return self.transforms(img)


class PresetEval:
    def __init__(self, *, crop_size, resize_size, use_v2=False):
        M = V2 if use_v2 else V1
        ts = [M.Resize(resize_size, antialias=True), M.CenterCrop(crop_size), M.PILToTensor(),
              M.ToDtype(torch.float, scale=True) if use_v2 else M.ConvertImageDtype(torch.float),
              M.Normalize(mean=MEAN, std=STD)]
        if use_v2:
            ts.append(M.ToPureTensor())
        self.transforms = M.Compose(ts)

    def __call__(self, img):
        return self.transforms(img)


# ------------------------------------------------------------ reading through
class DoesMore(PresetTrain):
    def __call__(self, img):
        return self.transforms(img).flip(-1)


class PrintsToo(PresetTrain):
    def __call__(self, img):
        print("called")
        return self.transforms(img)


class OtherArgument(PresetTrain):
    def __call__(self, img):
        return self.transforms(img.convert("RGB"))


class ByProperty(PresetTrain):
    @property
    def pipeline(self):
        return self.transforms

    def __call__(self, img):
        return self.pipeline(img)


class OwnLookup(PresetTrain):
    def __getattribute__(self, name):
        return object.__getattribute__(self, name)


class Starred(PresetTrain):
    def __call__(self, *imgs):
        return self.transforms(*imgs)


class ClassLevel:
    transforms = V1.Compose([V1.PILToTensor()])

    def __call__(self, img):
        return self.transforms(img)


def test_an_object_that_only_applies_what_it_holds_is_read_through():
    assert holder_attribute(PresetTrain(crop_size=16)) == "transforms"
    assert holder_attribute(PresetEval(crop_size=16, resize_size=20, use_v2=True)) == "transforms"
    for other in (DoesMore(crop_size=16), PrintsToo(crop_size=16), OtherArgument(crop_size=16),
                  ByProperty(crop_size=16), OwnLookup(crop_size=16), Starred(crop_size=16), ClassLevel(),
                  lambda img: img):
        assert holder_attribute(other) is None, type(other).__name__


@pytest.mark.parametrize("use_v2", [False, True])
def test_presets_translate_as_their_compose(use_v2):
    for preset in (PresetTrain(crop_size=224, use_v2=use_v2),
                   PresetEval(crop_size=224, resize_size=256, use_v2=use_v2)):
        a, fa, ra = translate(preset)
        b, fb, rb = translate(preset.transforms)
        assert (fa, ra) == (fb, rb) and ra == (), (fa, ra)   # v2's ToPureTensor fuses too
        assert a == b and type(a) is T.Compose


@pytest.mark.parametrize("use_v2", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_preset_runs_as_its_compose_and_says_it_was_read_through(photos, use_v2, num_workers):
    preset = PresetTrain(crop_size=16, use_v2=use_v2)
    L = coordl.DataLoader(D.ImageFolder(photos, transform=preset), batch_size=6, shuffle=True, seed=4,
                          num_workers=num_workers)
    s = L.stats()
    assert s.path == "coordl" and "read through PresetTrain.transforms" in s.path_reason, s.path_reason
    assert "fused RandomResizedCrop, RandomHorizontalFlip, PILToTensor" in s.path_reason, s.path_reason
    ref = coordl.DataLoader(D.ImageFolder(photos, transform=preset.transforms), batch_size=6, shuffle=True,
                            seed=4)
    got, want = list(L), list(ref)
    assert len(got) == len(want) == 4
    assert all(torch.equal(x, rx) and torch.equal(y, ry) for (x, y), (rx, ry) in zip(got, want))


def test_a_preset_that_does_more_runs_as_written(photos):
    ds = D.ImageFolder(photos, transform=DoesMore(crop_size=16))
    L = coordl.DataLoader(ds, batch_size=6, seed=1)
    assert "fused nothing; as written: DoesMore" in L.stats().path_reason, L.stats().path_reason
    x, _ = next(iter(L))
    assert x.shape == (6, 3, 16, 16)


# ------------------------------------------------- after an as-written step
@pytest.mark.parametrize("policy", ["ra", "ta_wide", "augmix"])
@pytest.mark.parametrize("use_v2", [False, True])
def test_steps_after_an_auto_augment_run_without_a_generator(policy, use_v2):
    out, fused, rest = translate(PresetTrain(crop_size=32, policy=policy, use_v2=use_v2))
    assert isinstance(out, TorchvisionPipeline) and fused == ("RandomResizedCrop", "RandomHorizontalFlip")
    # (AugMix runs on the decoded planes: tests/test_color_jitter.py)
    assert [type(getattr(t, "user", t)).__name__ for t in out.tail] == [
        {"ra": "RandAugment", "ta_wide": "TrivialAugmentWide", "augmix": "AugMix"}[policy]]
    assert [type(t).__name__ for t in out.post] == (
        ["PILToTensor", "ToDtype", "Normalize", "ToPureTensor"] if use_v2 else
        ["PILToTensor", "ConvertImageDtype", "Normalize"])
    assert [type(t) for t in out.post_fused.transforms] == [T.ToTensor, T.Normalize]
    assert out.post_type is None


@pytest.mark.parametrize("policy", ["ra", "augmix"])
@pytest.mark.parametrize("use_v2", [False, True])
def test_the_post_steps_give_what_the_user_steps_give(photos, policy, use_v2):
    """On the same sample and generator: coordl's conversion after the
    as-written step equals the user's own steps, within float rounding, and
    the draws of the as-written step are untouched by the move."""
    out = translate(PresetTrain(crop_size=32, policy=policy, use_v2=use_v2))[0]
    as_written = TorchvisionPipeline(out.fused, out.to_pil, out.image_type,
                                     [getattr(t, "user", t) for t in out.tail] + out.post)
    path = os.path.join(photos, sorted(os.listdir(photos))[0])
    path = os.path.join(path, sorted(os.listdir(path))[0])
    with open(path, "rb") as f:
        raw = f.read()
    for i in range(6):
        with _rng.sample_rng(3, 0, i):
            a = out.from_bytes(raw)
        with _rng.sample_rng(3, 0, i):
            b = as_written.from_bytes(raw)
        assert type(a) is torch.Tensor and a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_generators_of_the_process_are_left_as_they_were():
    out = translate(PresetTrain(crop_size=24, policy="ra"))[0]
    from PIL import Image

    img = Image.fromarray(torch.randint(0, 256, (40, 50, 3), dtype=torch.uint8).numpy())
    torch.manual_seed(7)
    random.seed(7)
    before = torch.get_rng_state(), random.getstate()
    with _rng.sample_rng(1, 0, 5):
        first = out(img)
    with _rng.sample_rng(1, 0, 5):
        again = out(img)
    assert torch.equal(first, again)    # the sample's draws, whatever the process's generators
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


def test_the_hand_over_to_pil_and_back_keeps_every_value():
    import numpy as np
    from PIL import Image

    from coordl.tvcompat import _pil_through, _to_pil

    g = torch.Generator().manual_seed(0)
    for c, mode in ((3, "RGB"), (1, "L")):
        x = torch.randint(0, 256, (c, 37, 53), dtype=torch.uint8, generator=g)
        img = _to_pil(x)
        assert img.mode == mode and img.size == (53, 37)
        assert np.array_equal(np.asarray(img).reshape(37, 53, c), x.permute(1, 2, 0).numpy())
        x = x[:, :, 1:]   # a view: not contiguous
        assert np.array_equal(np.asarray(_to_pil(x)).reshape(37, 52, c), x.permute(1, 2, 0).numpy())
    img = Image.fromarray(torch.randint(0, 256, (30, 40, 3), dtype=torch.uint8, generator=g).numpy())
    steps = [T.ToTensor(), T.Normalize(MEAN, STD)]
    want = T.Normalize(MEAN, STD)(T.ToTensor()(img))
    assert torch.equal(_pil_through(img, steps), want)
    assert torch.equal(_pil_through(img, [T.PILToTensor()]), T.PILToTensor()(img))
