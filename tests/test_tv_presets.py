"""torchvision's classification preset, what ``weights.transforms()`` gives
for every pretrained classifier (``torchvision.transforms._presets.
ImageClassification``: resize, center crop, to tensor, to float,
normalize), read as those steps and fused: torchvision's own batches.  And
the ``convert("RGB")`` function that OpenAI's CLIP and open_clip put in
their preprocessing, taken as the copy it is of an RGB image."""
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _torchvision import import_torchvision  # noqa: E402

if import_torchvision() is None:
    pytest.skip("torchvision is not installed (pip install coordl[test])", allow_module_level=True)

import torchvision  # noqa: E402
from torchvision import datasets as D  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from torchvision.datasets.vision import VisionDataset  # noqa: E402
from torchvision.transforms import v2  # noqa: E402
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


# ------------------------------------------------------------ CLIP's conversion to RGB
def _convert_image_to_rgb(image):          # as OpenAI's CLIP writes it
    return image.convert("RGB")


def _convert_to_rgb(image):                # as open_clip writes it
    return image.convert('RGB')


CLIP_NORM = T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@pytest.mark.parametrize("convert", [_convert_image_to_rgb, _convert_to_rgb, T.Lambda(lambda im: im.convert("RGB")),
                                     v2.Lambda(lambda im: im.convert("RGB"))],
                         ids=["clip", "open_clip", "Lambda", "v2.Lambda"])
def test_clips_eval_preprocessing_fuses_and_gives_torchvisions_batches(photos, convert):
    tf = T.Compose([T.Resize(40, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(40), convert,
                    T.ToTensor(), CLIP_NORM])
    ds = D.ImageFolder(photos, tf)
    L = coordl.DataLoader(ds, batch_size=4, num_workers=2)
    reason = L.stats().path_reason
    assert "fused Resize, CenterCrop, " in reason and "ToTensor, Normalize" in reason, reason
    assert "as written" not in reason, reason
    for (x, y), (a, b) in zip(batches(L), torch_batches(ds)):
        assert torch.equal(x, a) and torch.equal(y, b)


def test_open_clips_training_preprocessing_draws_and_gives_what_it_gives_without_the_conversion(photos):
    """RandomResizedCrop(scale=(0.9, 1.0), bicubic), the conversion, ToTensor,
    Normalize: the same draws and pixels as the same pipeline without the
    conversion (a copy of an RGB image)."""
    def tf(*convert):
        return T.Compose([T.RandomResizedCrop(40, scale=(0.9, 1.0), interpolation=T.InterpolationMode.BICUBIC),
                          *convert, T.ToTensor(), CLIP_NORM])

    with_it = coordl.DataLoader(D.ImageFolder(photos, tf(_convert_to_rgb)), batch_size=4, shuffle=True, seed=3)
    without = coordl.DataLoader(D.ImageFolder(photos, tf()), batch_size=4, shuffle=True, seed=3)
    assert "fused RandomResizedCrop, _convert_to_rgb, ToTensor, Normalize" in with_it.stats().path_reason
    for (x, y), (a, b) in zip(batches(with_it), batches(without)):
        assert torch.equal(x, a) and torch.equal(y, b)


def _mnist(transform, n=12):
    ds = torchvision.datasets.MNIST.__new__(torchvision.datasets.MNIST)
    VisionDataset.__init__(ds, "/nonexistent", transform=transform)
    g = torch.Generator().manual_seed(n)
    ds.data = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
    ds.targets = torch.randint(0, 10, (n,), generator=g)
    ds.train = True
    return ds


def test_the_conversion_of_a_gray_image_runs_as_written():
    """MNIST's images are gray: ``convert("RGB")`` makes three channels of
    them (a recipe for pretrained networks), so it is not dropped."""
    ds = _mnist(T.Compose([T.Lambda(lambda im: im.convert("RGB")), T.ToTensor()]))
    L = coordl.DataLoader(ds, batch_size=4)
    reason = L.stats().path_reason
    assert "fused nothing; as written: Lambda, ToTensor" in reason, reason
    got, want = batches(L), torch_batches(ds)
    assert got[0][0].shape == (4, 3, 28, 28)
    for (x, y), (a, b) in zip(got, want):
        assert torch.equal(x, a) and torch.equal(y, b)


def _to_gray(image):
    return image.convert("L")


def _convert_and_more(image):
    return image.convert("RGB").rotate(90)


def _convert_with_default(image, mode="RGB"):
    return image.convert(mode)


@pytest.mark.parametrize("fn", [_to_gray, _convert_and_more, _convert_with_default,
                                lambda im, mode="RGB": im.convert(mode)],
                         ids=["to L", "and more", "default mode", "lambda with default"])
def test_other_functions_run_as_written(photos, fn):
    ds = D.ImageFolder(photos, T.Compose([T.Resize(40), T.CenterCrop(40), fn, T.PILToTensor()]))
    L = coordl.DataLoader(ds, batch_size=4)
    reason = L.stats().path_reason
    assert f"fused Resize, CenterCrop; as written: {fn.__name__}, PILToTensor" in reason, reason
    for (x, y), (a, b) in zip(batches(L), torch_batches(ds)):
        assert torch.equal(x, a) and torch.equal(y, b)


def test_the_conversion_of_a_tensor_fails_as_it_does_under_torch(photos):
    ds = D.ImageFolder(photos, T.Compose([T.Resize(40), T.PILToTensor(), _convert_to_rgb]))
    L = coordl.DataLoader(ds, batch_size=4)
    assert "fused Resize, PILToTensor; as written: _convert_to_rgb" in L.stats().path_reason
    with pytest.raises(AttributeError, match="convert"):
        next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    with pytest.raises(Exception, match="convert"):
        next(iter(L))


def test_the_rgb_copy_is_pil_s(photos):
    """What the conversion is taken for: PIL's convert("RGB") of an RGB image
    is a copy with the same pixels."""
    path = D.ImageFolder(photos).samples[0][0]
    with Image.open(path) as im:
        rgb = im.convert("RGB")
    assert rgb.mode == "RGB" and np.array_equal(np.asarray(rgb.convert("RGB")), np.asarray(rgb))


def test_a_conversion_assigned_to_a_gray_datasets_loader_runs_as_written():
    """The same on a transform assigned to ``loader.dataset`` (coordl's copy of
    MNIST): translated as a gray dataset's, the conversion kept."""
    ds = _mnist(T.Compose([T.ToTensor()]))
    L = coordl.DataLoader(ds, batch_size=4)
    assert next(iter(L))[0].shape == (4, 1, 28, 28)
    new = T.Compose([T.CenterCrop(20), _convert_to_rgb, T.ToTensor()])
    L.dataset.transform = new
    got = batches(L)
    reason = L.stats().path_reason
    assert "the transform assigned to loader.dataset: fused CenterCrop; as written: _convert_to_rgb" in reason, reason
    ds.transform = new
    for (x, y), (a, b) in zip(got, torch_batches(ds)):
        assert x.shape == (4, 3, 20, 20) and torch.equal(x, a) and torch.equal(y, b)


@pytest.mark.parametrize("which", ["preset", "clip"])
def test_jobs_sharing_prep_get_what_they_get_alone(photos, daemon_env, which):
    """Both translate whole, so the node daemon's workers unpickle them
    without torchvision (or the script's own function)."""
    def make():
        tf = ImageClassification(crop_size=40, resize_size=46) if which == "preset" else T.Compose(
            [T.Resize(40, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(40), _convert_image_to_rgb,
             T.ToTensor(), CLIP_NORM])
        return D.ImageFolder(photos, tf)

    alone = batches(coordl.DataLoader(make(), batch_size=4, seed=4))
    L = coordl.DataLoader(make(), batch_size=4, seed=4, share=True)
    got = batches(L)
    assert len(got) == len(alone) and all(torch.equal(x, a) and torch.equal(y, b) for (x, y), (a, b) in zip(got, alone))
    assert L.stats().samples_shared > 0, L.stats()
