"""torchvision's classification preset, what ``weights.transforms()`` gives
for every pretrained classifier (``torchvision.transforms._presets.
ImageClassification``: resize, center crop, to tensor, to float,
normalize), read as those steps and fused: torchvision's own batches."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

from torchvision import datasets as D  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from torchvision.transforms import InterpolationMode  # noqa: E402
from torchvision.transforms._presets import ImageClassification  # noqa: E402

import coordl  # noqa: E402

PRESET_STEPS = "Resize, CenterCrop, PresetToTensor, ConvertImageDtype, Normalize"


@pytest.fixture(scope="module")
def photos(photo_folder):
    # sizes on both sides of the resize, odd ones among them
    return photo_folder("tv_presets", num_images=16, num_classes=2, mean_kb=4, image_size=(75, 53), seed=5)


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def torch_batches(ds, **kw):
    return batches(torch.utils.data.DataLoader(ds, batch_size=4, **kw))


@pytest.mark.parametrize("interpolation", [InterpolationMode.BILINEAR, InterpolationMode.BICUBIC])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_weights_preset_fuses_and_gives_torchvisions_batches(photos, interpolation, num_workers):
    preset = ImageClassification(crop_size=40, resize_size=46, interpolation=interpolation,
                                 mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    ds = D.ImageFolder(photos, preset)
    L = coordl.DataLoader(ds, batch_size=4, num_workers=num_workers)
    s = L.stats()
    assert s.path == "coordl", s
    assert f"read through ImageClassification as {PRESET_STEPS}; fused {PRESET_STEPS}" in s.path_reason, s
    assert "as written" not in s.path_reason, s
    mine, theirs = batches(L), torch_batches(ds)
    assert len(mine) == len(theirs) == 4
    for (x, y), (a, b) in zip(mine, theirs):
        assert x.dtype == a.dtype == torch.float32 and x.shape == a.shape == (4, 3, 40, 40)
        assert torch.equal(x, a) and torch.equal(y, b)


def test_the_reference_scripts_tensor_backend_fuses_within_v1s_tensor_resize_tolerance(photos):
    """train.py's ``--backend tensor`` eval: PILToTensor, then the preset on
    the uint8 tensor (no conversion of its own there)."""
    preset = ImageClassification(crop_size=40, resize_size=46, antialias=True)
    ds = D.ImageFolder(photos, T.Compose([T.PILToTensor(), preset]))
    L = coordl.DataLoader(ds, batch_size=4)
    s = L.stats()
    assert "as written" not in s.path_reason and "fused PILToTensor, Resize, CenterCrop, PresetToTensor" in \
        s.path_reason, s
    one_level = 1 / 255 / min(preset.std) + 1e-6     # v1 resizes a uint8 tensor in float32: 1 level (the guide)
    for (x, y), (a, b) in zip(batches(L), torch_batches(ds)):
        assert x.shape == a.shape and torch.equal(y, b)
        assert (x - a).abs().max().item() <= one_level


def test_a_preset_with_a_forward_hook_runs_as_written(photos):
    preset = ImageClassification(crop_size=40, resize_size=46)
    seen = []
    preset.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    ds = D.ImageFolder(photos, preset)
    L = coordl.DataLoader(ds, batch_size=4)
    s = L.stats()
    assert "fused nothing; as written: ImageClassification" in s.path_reason, s
    mine = batches(L)
    assert len(seen) == 16                          # the hook ran for every sample, in this process
    for (x, y), (a, b) in zip(mine, torch_batches(ds)):
        assert torch.equal(x, a) and torch.equal(y, b)


def test_a_global_forward_hook_keeps_the_preset_as_written(photos):
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(1))
    try:
        ds = D.ImageFolder(photos, ImageClassification(crop_size=40, resize_size=46))
        L = coordl.DataLoader(ds, batch_size=4)
        assert "fused nothing; as written: ImageClassification" in L.stats().path_reason
        assert len(batches(L)) == 4 and len(seen) == 16
    finally:
        handle.remove()


def test_a_subclass_of_the_preset_runs_as_written(photos):
    class Mine(ImageClassification):
        def forward(self, img):
            return super().forward(img) * 2

    ds = D.ImageFolder(photos, Mine(crop_size=40, resize_size=46))
    L = coordl.DataLoader(ds, batch_size=4)
    assert "fused nothing; as written: Mine" in L.stats().path_reason
    for (x, y), (a, b) in zip(batches(L), torch_batches(ds)):
        assert torch.equal(x, a) and torch.equal(y, b)


def test_the_preset_after_an_unknown_step_runs_as_written_on_what_that_step_gives(photos):
    ds = D.ImageFolder(photos, T.Compose([T.Lambda(lambda im: im.rotate(90, expand=True)),
                                          ImageClassification(crop_size=40, resize_size=46)]))
    L = coordl.DataLoader(ds, batch_size=4, num_workers=0)
    reason = L.stats().path_reason
    assert f"as written: Lambda, {PRESET_STEPS}" in reason, reason
    for (x, y), (a, b) in zip(batches(L), torch_batches(ds)):
        assert torch.equal(x, a) and torch.equal(y, b)


def test_the_preset_after_to_tensor_runs_its_steps_as_written_on_the_float_tensor(photos):
    """ToTensor gives floats: the preset's resize of a float tensor is not
    fused, and its own conversion leaves the tensor as it is."""
    ds = D.ImageFolder(photos, T.Compose([T.ToTensor(), ImageClassification(crop_size=40, resize_size=46)]))
    L = coordl.DataLoader(ds, batch_size=4)
    reason = L.stats().path_reason
    assert f"fused ToTensor; as written: {PRESET_STEPS}" in reason, reason
    for (x, y), (a, b) in zip(batches(L), torch_batches(ds)):
        assert torch.equal(x, a) and torch.equal(y, b)


# docs/guide/gpu.md, "Same semantics as the CPU path, and the tolerance" (as tests/test_device_decode.py)
DECODE_MEAN, DECODE_MAX = 6.0, 96


def test_decode_on_the_device_takes_the_preset(photos, cpu_device):
    """decode="device" (the CPU stand-in here) runs the preset's steps on the
    device path: the same shapes and labels, values within the documented
    bound of the CPU path."""
    preset = ImageClassification(crop_size=40, resize_size=46)
    ds = D.ImageFolder(photos, preset)
    cpu = batches(coordl.DataLoader(ds, batch_size=4, seed=1))
    dev = coordl.DataLoader(ds, batch_size=4, seed=1, device="cpu", decode="device")
    got = batches(dev)
    st = dev.stats()
    assert st.device_decode.endswith("Resize + CenterCrop -> 40x40 (bilinear), ToTensor + Normalize"), st
    assert (st.device_decode_images, st.device_decode_cpu_images) == (16, 0)
    std255 = torch.tensor(preset.std).view(1, 3, 1, 1) * 255
    assert len(got) == len(cpu) == 4
    for (x, y), (a, b) in zip(got, cpu):
        assert x.shape == a.shape and torch.equal(y, b)
        levels = (x - a).abs() * std255
        assert levels.mean().item() <= DECODE_MEAN and levels.max().item() <= DECODE_MAX
