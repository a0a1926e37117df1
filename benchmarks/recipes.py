"""The recipes people run, with only the DataLoader import changed: torch's
DataLoader vs coordl's, side by side, same call, same workers.

Recipes (``--recipes``, comma-separated; default all):

``train_v1``, ``train_v2``, ``train_v1_ra``, ``train_v2_ra``, ``train_v1_ta``,
``train_v2_ta``, ``train_v1_augmix``, ``train_v2_augmix``
    torchvision's references/classification/train.py training loader as
    written: ``ImageFolder(root, ClassificationPresetTrain(crop_size=224,
    auto_augment_policy=..., use_v2=...))`` and
    ``DataLoader(ds, batch_size, sampler=RandomSampler(ds), num_workers,
    pin_memory=True, collate_fn=default_collate)``.
``train_v2_mixup``
    ``train_v2`` with ``--mixup-alpha 0.2 --cutmix-alpha 1.0`` (the recipe
    of ResNet-50's V2 weights): the script's ``collate_fn`` returns
    ``RandomChoice([MixUp(alpha=0.2), CutMix(alpha=1.0)])(*default_collate(batch))``,
    new tensors made in the workers, and soft labels (whose column sums
    are each class's count: the check of every sample once).
``train_v1_tensor_ta``, ``train_v2_tensor_ta``, ``train_v1_tensor_augmix``, ``train_v2_tensor_augmix``
    the same with ``--auto-augment ta_wide`` (or ``augmix``) ``--backend tensor``
    (``backend="tensor"``: ``PILToTensor`` before the crop).
``train_v1_tensor_bicubic``
    the v1 training loader with ``--backend tensor --interpolation bicubic``
    (the crop of the tensor resized in float32, as v1 resizes a tensor).
``cifar_v1``, ``cifar_v2``
    the CIFAR-style tutorial recipe on an ``ImageFolder``:
    ``RandomCrop(size, padding=4)``, ``RandomHorizontalFlip()``,
    ``ToTensor()`` (v2: ``ToImage()``, ``ToDtype(torch.float32,
    scale=True)``), ``Normalize``, ``shuffle=True`` (give it a folder of
    small images and ``--size`` their side).
``eval_v1``, ``eval_v2``
    its validation loader: ``ClassificationPresetEval(crop_size=224,
    resize_size=256)``, ``sampler=SequentialSampler(ds)``, ``pin_memory=True``.
``eval_weights``
    its validation loader with ``--weights`` (``--test-only``): the
    pretrained weights' own preset, ``weights.transforms(antialias=True)``
    (``ImageClassification``; ResNet-50's V2 weights' sizes, resize 232 of
    crop 224, scaled with ``--size``), ``SequentialSampler``,
    ``pin_memory=True``.
``clip_eval``
    OpenAI CLIP's image preprocessing (its ``_transform(224)``, which
    open_clip's eval transform repeats): ``Resize(224, bicubic)``,
    ``CenterCrop(224)``, a function returning ``image.convert("RGB")``,
    ``ToTensor()``, ``Normalize`` with CLIP's statistics, on
    ``ImageFolder``, ``shuffle=False`` (zero-shot evaluation, linear probes).
``timm_train``, ``timm_eval``
    ``timm.data.create_transform(224, is_training=...)`` (timm's defaults)
    on ``ImageFolder``, ``shuffle=True`` / ``False``.
``timm_train_script``
    the same training transform with ``interpolation="random"``, the
    default of timm's ``train.py`` (``--train-interpolation``).
``timm_train_cj_prob``
    the training transform with ``color_jitter_prob=0.8`` (its
    ``ColorJitter`` inside a ``RandomApply``).
``timm_train_aa``
    the training transform with ``auto_augment="rand-m9-mstd0.5"`` (timm's
    ``RandAugment``, its recipes' ``--aa``).
``decode_image_train``, ``decode_image_eval``
    a v2 script that feeds its transforms tensors: ``ImageFolder(root, tf,
    loader=torchvision.io.decode_image)`` with ``v2.RandomResizedCrop(size,
    antialias=True)``, ``v2.RandomHorizontalFlip()``,
    ``v2.ToDtype(torch.float32, scale=True)``, ``v2.Normalize``,
    ``shuffle=True``; and its evaluation with
    ``loader=functools.partial(decode_image, mode=ImageReadMode.RGB)``,
    ``v2.Resize(size * 256 // 224, antialias=True)``, ``v2.CenterCrop``,
    the same conversion, ``shuffle=False``.  Left out where torchvision's
    image decoders do not load (torchvision beside torch's CPU build).
``food101_train``, ``food101_eval``
    ``train_v1`` and ``eval_v1``'s presets on torchvision's ``Food101``
    (a list of image files and class indices, as its ``Flowers102``,
    ``DTD``, ``StanfordCars``... are) listing the root's files, set as its
    constructor sets them (the real one needs its download), with
    ``shuffle=True`` / ``False``.
``resize_crop_v1``, ``resize_crop_v2``
    the older ImageNet training recipe many fine-tuning scripts keep:
    ``Resize(size * 256 // 224)``, ``RandomCrop(size)``,
    ``RandomHorizontalFlip()``, the conversion as ``cifar_v1``/``cifar_v2``,
    ``Normalize``, on ``ImageFolder``, ``shuffle=True``.
``moco_v2``, ``dino``
    self-supervised recipes whose transform makes several views of each
    image: MoCo v2's (``--aug-plus``: two views of ``RandomResizedCrop(size,
    scale=(0.2, 1))``, ``ColorJitter(0.4, 0.4, 0.4, 0.1)`` with p 0.8,
    ``RandomGrayscale(0.2)``, a PIL Gaussian blur of radius 0.1-2 with p
    0.5 (a class of the recipe's own), flip, ``ToTensor``, ``Normalize``)
    and DINO's (two global bicubic crops at ``size``, scale 0.4-1, eight
    local ones at ``size * 96 // 224``, scale 0.05-0.4, each flipped,
    colour-jittered, made gray, blurred and, the second global one,
    solarized as its recipe does), on ``ImageFolder``, ``shuffle=True``,
    ``drop_last=True``; images/s counts samples.
``cifar10_v1``, ``cifar10_v2``
    the CIFAR tutorial recipe (``cifar_v1``/``cifar_v2``'s transform,
    ``shuffle=True``) on torchvision's ``CIFAR10``, whose images are an
    array in memory: made as its constructor leaves it, over 10,000
    random 32x32 images (the real one needs its download; the transform's
    cost does not depend on the pixels).
``mnist``
    PyTorch's MNIST example's loader on torchvision's ``MNIST`` (images in
    memory, a tensor): ``ToTensor()``, ``Normalize((0.1307,), (0.3081,))``,
    ``shuffle=True``, made as its constructor leaves it over 60,000 random
    28x28 images.
``timm_ds_train``, ``timm_ds_eval``
    timm's own dataset and loader, as its ``train.py`` and ``validate.py``
    build them: ``timm.data.create_dataset("", root)`` (an ``ImageDataset``
    over a ``ReaderImageFolder``) and ``timm.data.create_loader(ds,
    input_size=(3, size, size), is_training=...)`` with its defaults (the
    prefetcher's ``fast_collate`` and uint8 samples, persistent workers;
    training: ``train.py``'s random interpolation and ``color_jitter=0.4``,
    the last partial batch dropped; evaluation: bicubic with
    ``crop_pct=0.95``, timm's ResNet-50 weights' settings), with
    ``torch.utils.data.DataLoader`` pointed at the loader under test while
    ``create_loader`` runs (it looks the name up when called).
``timm_ds_augmix``
    ``train.py --aug-splits 3 --jsd-loss --aa augmix-m3-w3`` (AugMix with
    the JSD loss): timm's ``AugMixDataset(create_dataset(...),
    num_splits=3)`` and ``create_loader(..., num_aug_splits=3,
    auto_augment="augmix-m3-w3")``, otherwise as ``timm_ds_train``; each
    sample is three views (the clean one and two through AugMix), which
    ``fast_collate`` lays one after another: images count views.

The preset classes come from ``--presets PATH``, a copy of torchvision's
``references/classification/presets.py`` (not shipped with coordl: fetch
it from the torchvision repository), when given; a copy without ``use_v2``
(older torchvision) serves the v1 rows, and the v2 rows then use the
equivalent classes below.  Without ``--presets`` every row uses those
classes: written here with the reference presets' structure (a Compose
built in ``__init__``, ``__call__`` returning ``self.transforms(img)``).

Each round runs every recipe with both loaders, alternating which goes
first; a loader runs ``--epochs`` epochs from its construction (worker
start-up included, as a user sees it).  The ratio is the median over
rounds of coordl's images/s over torch's.  Beside it, the CPU each side
spent per image (this process and its reaped children, the workers:
``getrusage``), whose ratio other processes on a shared machine move much
less than they move wall time.  Checked: every epoch delivers
every sample once with the dataset's targets (torch's RandomSampler and
coordl's read of it give the same indices for the same torch seed).

``--accelerate`` runs both sides under Hugging Face Accelerate (one
process, ``Accelerator(cpu=True)``): torch's loader through
``accelerator.prepare``, coordl's through ``coordl.accelerate.prepare``,
as a script using Accelerate prepares each; ``--accelerate plain``
passes coordl's loader to ``accelerator.prepare`` too (which rebuilds it
on torch's class).

    python -m coordl.synth bench_data/photos --images 400
    python benchmarks/recipes.py --root bench_data/photos --presets /tmp/presets.py
    python benchmarks/recipes.py --quick          # tiny smoke run

Writes bench_out/recipes.json.
"""
from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import inspect
import os
import random
import resource
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def _convert_image_to_rgb(image):
    """The conversion CLIP's preprocessing puts between its crop and ToTensor."""
    return image.convert("RGB")
VIEWS = {"timm_ds_augmix": 3}      # the views of each sample (timm's AugMixDataset)


class PILBlur:
    """The self-supervised recipes' blur: with probability ``p``, PIL's
    Gaussian blur of a radius drawn uniformly in [lo, hi] (Python's generator)."""

    def __init__(self, p=1.0, lo=0.1, hi=2.0):
        self.p, self.lo, self.hi = p, lo, hi

    def __call__(self, img):
        from PIL import ImageFilter

        if random.random() > self.p:
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(self.lo, self.hi)))


class PILSolarize:
    """DINO's solarization: with probability ``p``, PIL's solarize at 128."""

    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        from PIL import ImageOps

        return ImageOps.solarize(img) if random.random() < self.p else img


class TwoViews:
    """MoCo v2's query and key: the same transform twice."""

    def __init__(self, base):
        self.base = base

    def __call__(self, x):
        return [self.base(x), self.base(x)]


class GlobalLocalViews:
    """DINO's crops: two global views of their own transforms, then ``n`` local ones."""

    def __init__(self, T, size, n=8):
        flip_jitter = T.Compose([T.RandomHorizontalFlip(p=0.5), T.RandomApply(
            [T.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)], p=0.8), T.RandomGrayscale(p=0.2)])
        norm = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
        self.global1 = T.Compose([T.RandomResizedCrop(size, scale=(0.4, 1.0), interpolation=T.InterpolationMode.BICUBIC),
                                  flip_jitter, PILBlur(1.0), norm])
        self.global2 = T.Compose([T.RandomResizedCrop(size, scale=(0.4, 1.0), interpolation=T.InterpolationMode.BICUBIC),
                                  flip_jitter, PILBlur(0.1), PILSolarize(0.2), norm])
        self.n = n
        self.local = T.Compose([T.RandomResizedCrop(size * 96 // 224, scale=(0.05, 0.4),
                                                    interpolation=T.InterpolationMode.BICUBIC),
                                flip_jitter, PILBlur(0.5), norm])

    def __call__(self, image):
        crops = [self.global1(image), self.global2(image)]
        for _ in range(self.n):
            crops.append(self.local(image))
        return crops
POLICIES = {"": None, "_ra": "ra", "_ta": "ta_wide", "_augmix": "augmix"}
RECIPES = ([f"train_{v}{p}" for p in POLICIES for v in ("v1", "v2")]
           + ["train_v2_mixup", "train_v1_tensor_ta", "train_v2_tensor_ta", "train_v1_tensor_augmix",
              "train_v2_tensor_augmix", "train_v1_tensor_bicubic"]
           + ["eval_v1", "eval_v2", "eval_weights", "clip_eval"]
           + ["timm_train", "timm_train_script", "timm_train_cj_prob", "timm_train_aa", "timm_eval"]
           + ["timm_ds_train", "timm_ds_eval", "timm_ds_augmix", "food101_train", "food101_eval", "cifar10_v1", "cifar10_v2", "mnist"]
           + ["cifar_v1", "cifar_v2", "resize_crop_v1", "resize_crop_v2", "moco_v2", "dino", "split_train", "split_eval", "concat_train", "eval_paths"]
           + ["decode_image_train", "decode_image_eval"])


_WITH_PATHS: list = []


class MixupCollate:
    """The reference script's ``collate_fn`` under ``--mixup-alpha 0.2
    --cutmix-alpha 1.0``: ``mixup_cutmix(*default_collate(batch))``, with
    its v2 transforms (a class here rather than its closure, for spawn)."""

    def __init__(self, num_classes: int) -> None:
        from torchvision.transforms import v2

        self.mixup_cutmix = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=num_classes),
                                             v2.CutMix(alpha=1.0, num_classes=num_classes)])

    def __call__(self, batch):
        return self.mixup_cutmix(*torch.utils.data.default_collate(batch))


def _with_paths(tv):
    """``ImageFolderWithPaths`` as scripts write it (made once, at module level for the workers)."""
    if not _WITH_PATHS:
        class ImageFolderWithPaths(tv.datasets.ImageFolder):
            def __getitem__(self, index):
                original_tuple = super().__getitem__(index)
                path = self.imgs[index][0]
                return original_tuple + (path,)

        ImageFolderWithPaths.__qualname__ = "ImageFolderWithPaths"
        globals()["ImageFolderWithPaths"] = ImageFolderWithPaths
        _WITH_PATHS.append(ImageFolderWithPaths)
    return _WITH_PATHS[0]


def _cpu() -> float:
    """CPU seconds of this process and of its reaped children (the workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class PresetTrain:
    """The reference training preset's structure (see the module docstring)."""

    def __init__(self, *, crop_size, auto_augment_policy=None, use_v2=False, backend="pil", interpolation=None):
        common.torchvision()
        if use_v2:
            from torchvision.transforms import v2 as M
        else:
            from torchvision import transforms as M
        interpolation = interpolation or M.InterpolationMode.BILINEAR
        steps = [M.PILToTensor()] if backend == "tensor" else []
        steps += [M.RandomResizedCrop(crop_size, interpolation=interpolation, antialias=True),
                  M.RandomHorizontalFlip(0.5)]
        if auto_augment_policy == "ra":
            steps.append(M.RandAugment())
        elif auto_augment_policy == "ta_wide":
            steps.append(M.TrivialAugmentWide())
        elif auto_augment_policy == "augmix":
            steps.append(M.AugMix())
        if backend != "tensor":
            steps.append(M.PILToTensor())
        steps.append(M.ToDtype(torch.float, scale=True) if use_v2 else M.ConvertImageDtype(torch.float))
        steps.append(M.Normalize(mean=MEAN, std=STD))
        if use_v2:
            steps.append(M.ToPureTensor())
        self.transforms = M.Compose(steps)

    def __call__(self, img):
        return self.transforms(img)


class PresetEval:
    """The reference evaluation preset's structure."""

    def __init__(self, *, crop_size, resize_size=256, use_v2=False):
        common.torchvision()
        if use_v2:
            from torchvision.transforms import v2 as M
        else:
            from torchvision import transforms as M
        steps = [M.Resize(resize_size, antialias=True), M.CenterCrop(crop_size), M.PILToTensor(),
                 M.ToDtype(torch.float, scale=True) if use_v2 else M.ConvertImageDtype(torch.float),
                 M.Normalize(mean=MEAN, std=STD)]
        if use_v2:
            steps.append(M.ToPureTensor())
        self.transforms = M.Compose(steps)

    def __call__(self, img):
        return self.transforms(img)


def _load_presets(path: str | None):
    """(train class, eval class, takes use_v2, where from)."""
    if path is None:
        return PresetTrain, PresetEval, True, "the benchmark's own preset classes"
    common.torchvision()
    spec = importlib.util.spec_from_file_location("presets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    v2 = "use_v2" in inspect.signature(mod.ClassificationPresetTrain).parameters
    return mod.ClassificationPresetTrain, mod.ClassificationPresetEval, v2, path


def build(recipe: str, root: str, size: int, presets, cls, batch_size: int, workers: int):
    """The dataset and loader of ``recipe``, built with ``cls`` (the only difference)."""
    tv = common.torchvision()
    from torch.utils.data import RandomSampler, SequentialSampler, default_collate

    train_cls, eval_cls, has_v2, _ = presets
    if recipe.startswith("timm_ds"):
        from timm.data import create_dataset, create_loader

        training = recipe != "timm_ds_eval"
        ds = create_dataset("", root=root, split="", is_training=training)
        kw = ({"interpolation": "random", "color_jitter": 0.4} if training
              else {"interpolation": "bicubic", "crop_pct": 0.95})
        if recipe == "timm_ds_augmix":
            from timm.data import AugMixDataset

            ds = AugMixDataset(ds, num_splits=VIEWS[recipe])
            kw.update(num_aug_splits=VIEWS[recipe], auto_augment="augmix-m3-w3")
        torch_loader = torch.utils.data.DataLoader
        torch.utils.data.DataLoader = cls
        try:
            return ds, create_loader(ds, input_size=(3, size, size), batch_size=batch_size, is_training=training,
                                     num_workers=workers, device=torch.device("cpu"), **kw)
        finally:
            torch.utils.data.DataLoader = torch_loader
    if recipe == "mnist":
        T1 = tv.transforms
        ds = tv.datasets.MNIST.__new__(tv.datasets.MNIST)
        tv.datasets.vision.VisionDataset.__init__(
            ds, root, transform=T1.Compose([T1.ToTensor(), T1.Normalize((0.1307,), (0.3081,))]))
        g = torch.Generator().manual_seed(0)
        ds.data = torch.randint(0, 256, (60_000, 28, 28), dtype=torch.uint8, generator=g)
        ds.targets = torch.randint(0, 10, (60_000,), generator=g)
        ds.train = True
        return ds, cls(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
    if recipe.startswith("food101"):
        training = recipe == "food101_train"
        make = train_cls if training else eval_cls
        tf = make(crop_size=size) if training else make(crop_size=size, resize_size=size * 256 // 224)
        ds = tv.datasets.Food101.__new__(tv.datasets.Food101)
        tv.datasets.vision.VisionDataset.__init__(ds, root, transform=tf)
        samples = tv.datasets.ImageFolder(root).samples
        ds._image_files, ds._labels = [p for p, _ in samples], [t for _, t in samples]
        ds.loader = tv.datasets.folder.default_loader
        ds.targets = ds._labels        # for the benchmark's check of the labels
        return ds, cls(ds, batch_size=batch_size, shuffle=training, num_workers=workers)
    if recipe.startswith("timm"):
        from timm.data import create_transform

        training = recipe.startswith("timm_train")
        # timm's train.py passes interpolation="random" by default (--train-interpolation)
        kw = {"timm_train_script": {"interpolation": "random"},
              "timm_train_cj_prob": {"color_jitter_prob": 0.8},
              # timm's RandAugment (--aa); not its "inc1" variant, whose posterize to 0 bits Pillow 13 refuses
              "timm_train_aa": {"auto_augment": "rand-m9-mstd0.5"}}.get(recipe, {})
        ds = tv.datasets.ImageFolder(root, transform=create_transform(size, is_training=training, **kw))
        return ds, cls(ds, batch_size=batch_size, shuffle=training, num_workers=workers)
    if recipe.startswith("split_"):
        # one folder split by torch's random_split, as many scripts make their training and validation sets
        T1 = tv.transforms
        training = recipe == "split_train"
        tf = T1.Compose([T1.RandomResizedCrop(size), T1.RandomHorizontalFlip(), T1.ToTensor(), T1.Normalize(MEAN, STD)]
                        if training else [T1.Resize(size * 256 // 224), T1.CenterCrop(size), T1.ToTensor(),
                                          T1.Normalize(MEAN, STD)])
        parts = torch.utils.data.random_split(tv.datasets.ImageFolder(root, tf), [0.8, 0.2],
                                              generator=torch.Generator().manual_seed(0))
        ds = parts[0] if training else parts[1]
        return ds, cls(ds, batch_size=batch_size, shuffle=training, num_workers=workers)
    if recipe.startswith("decode_image"):
        import functools

        from torchvision.io import ImageReadMode, decode_image
        from torchvision.transforms import v2

        training = recipe == "decode_image_train"
        first = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()] if training else \
            [v2.Resize(size * 256 // 224, antialias=True), v2.CenterCrop(size)]
        tf = v2.Compose(first + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
        loader = decode_image if training else functools.partial(decode_image, mode=ImageReadMode.RGB)
        ds = tv.datasets.ImageFolder(root, tf, loader=loader)
        return ds, cls(ds, batch_size=batch_size, shuffle=training, num_workers=workers)
    if recipe == "eval_paths":
        # the evaluation loader of a script that writes its predictions per file: an ImageFolder subclass
        # returning each image's path beside it
        T1 = tv.transforms
        tf = T1.Compose([T1.Resize(size * 256 // 224), T1.CenterCrop(size), T1.ToTensor(), T1.Normalize(MEAN, STD)])
        ds = _with_paths(tv)(root, tf)
        return ds, cls(ds, batch_size=batch_size, shuffle=False, num_workers=workers)
    if recipe == "concat_train":
        # folders combined into one training set with torch's ConcatDataset (here the folder's two halves of
        # classes, listed as two folders of their own would be)
        T1 = tv.transforms
        tf = T1.Compose([T1.RandomResizedCrop(size), T1.RandomHorizontalFlip(), T1.ToTensor(), T1.Normalize(MEAN, STD)])
        classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
        half = len(classes) // 2

        def only(names):
            return lambda path: os.path.basename(os.path.dirname(path)) in names and path.lower().endswith(".jpg")

        ds = torch.utils.data.ConcatDataset([tv.datasets.ImageFolder(root, tf, is_valid_file=only(classes[:half]), allow_empty=True),
                                             tv.datasets.ImageFolder(root, tf, is_valid_file=only(classes[half:]), allow_empty=True)])
        return ds, cls(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
    if recipe == "clip_eval":
        T1 = tv.transforms
        tf = T1.Compose([T1.Resize(size, interpolation=T1.InterpolationMode.BICUBIC), T1.CenterCrop(size),
                         _convert_image_to_rgb, T1.ToTensor(), T1.Normalize(CLIP_MEAN, CLIP_STD)])
        ds = tv.datasets.ImageFolder(root, tf)
        return ds, cls(ds, batch_size=batch_size, shuffle=False, num_workers=workers)
    if recipe == "eval_weights":
        from torchvision.transforms._presets import ImageClassification

        # what ResNet50_Weights.IMAGENET1K_V2.transforms(antialias=True) makes (no download needed)
        tf = ImageClassification(crop_size=size, resize_size=size * 232 // 224, antialias=True)
        ds = tv.datasets.ImageFolder(root, tf)
        return ds, cls(ds, batch_size=batch_size, sampler=SequentialSampler(ds), num_workers=workers,
                       pin_memory=True)
    use_v2 = "_v2" in recipe
    kw = {"use_v2": True} if use_v2 else {}
    if recipe in ("moco_v2", "dino"):
        T = tv.transforms
        if recipe == "moco_v2":
            tf = TwoViews(T.Compose([T.RandomResizedCrop(size, scale=(0.2, 1.0)),
                                     T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
                                     T.RandomGrayscale(p=0.2), T.RandomApply([PILBlur()], p=0.5),
                                     T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]))
        else:
            tf = GlobalLocalViews(T, size)
        ds = tv.datasets.ImageFolder(root, transform=tf)
        return ds, cls(ds, batch_size=batch_size, shuffle=True, num_workers=workers, pin_memory=True, drop_last=True)
    if recipe.startswith("resize_crop"):
        M = importlib.import_module("torchvision.transforms.v2" if use_v2 else "torchvision.transforms")
        conv = [M.ToImage(), M.ToDtype(torch.float32, scale=True)] if use_v2 else [M.ToTensor()]
        tf = M.Compose([M.Resize(size * 256 // 224), M.RandomCrop(size), M.RandomHorizontalFlip(), *conv,
                        M.Normalize(MEAN, STD)])
        ds = tv.datasets.ImageFolder(root, transform=tf)
        return ds, cls(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
    if recipe.startswith("cifar"):
        M = importlib.import_module("torchvision.transforms.v2" if use_v2 else "torchvision.transforms")
        conv = [M.ToImage(), M.ToDtype(torch.float32, scale=True)] if use_v2 else [M.ToTensor()]
        in_memory = recipe.startswith("cifar10_")
        tf = M.Compose([M.RandomCrop(32 if in_memory else size, padding=4), M.RandomHorizontalFlip(), *conv,
                        M.Normalize(MEAN, STD)])
        if in_memory:
            ds = tv.datasets.CIFAR10.__new__(tv.datasets.CIFAR10)
            tv.datasets.vision.VisionDataset.__init__(ds, root, transform=tf)
            rng = np.random.default_rng(0)
            ds.data = rng.integers(0, 256, (10_000, 32, 32, 3), dtype=np.uint8)
            ds.targets = [int(t) for t in rng.integers(0, 10, len(ds.data))]
            ds.train = True
            return ds, cls(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
        ds = tv.datasets.ImageFolder(root, transform=tf)
        return ds, cls(ds, batch_size=batch_size, shuffle=True, num_workers=workers)
    if "_tensor" in recipe:
        kw["backend"] = "tensor"
        recipe = recipe.replace("_tensor", "")
    if recipe.endswith("_bicubic"):
        kw["interpolation"] = tv.transforms.InterpolationMode.BICUBIC
        recipe = recipe[:-len("_bicubic")]
    mixup = recipe.endswith("_mixup")
    recipe = recipe.removesuffix("_mixup")
    if recipe.startswith("train"):
        policy = POLICIES["_" + recipe.split("_", 2)[2] if recipe.count("_") == 2 else ""]
        make = train_cls if (has_v2 or not use_v2) else PresetTrain
        ds = tv.datasets.ImageFolder(root, make(crop_size=size, auto_augment_policy=policy, **kw))
        return ds, cls(ds, batch_size=batch_size, sampler=RandomSampler(ds), num_workers=workers, pin_memory=True,
                       collate_fn=MixupCollate(len(ds.classes)) if mixup else default_collate)
    make = eval_cls if (has_v2 or not use_v2) else PresetEval
    ds = tv.datasets.ImageFolder(root, make(crop_size=size, resize_size=size * 256 // 224, **kw))
    return ds, cls(ds, batch_size=batch_size, sampler=SequentialSampler(ds), num_workers=workers, pin_memory=True)


def _each_once(ds, labels: torch.Tensor, batch_size: int, drop_last: bool, views: int = 1) -> bool:
    """An epoch's ``labels`` are the dataset's targets, each sample at most
    once (in each of its ``views``), all of them but a dropped last partial
    batch's."""
    ds = getattr(ds, "dataset", ds) if views > 1 else ds     # timm's AugMixDataset wraps its ImageDataset
    if isinstance(ds, torch.utils.data.Subset):
        targets = [ds.dataset.targets[i] for i in ds.indices]
    elif isinstance(ds, torch.utils.data.ConcatDataset):
        targets = [t for d in ds.datasets for t in d.targets]
    else:
        targets = ds.targets if hasattr(ds, "targets") else [t for _, t in ds.reader.samples]   # timm's reader
    targets = targets.tolist() if isinstance(targets, torch.Tensor) else targets
    n = len(targets) // batch_size * batch_size if drop_last else len(targets)
    want = collections.Counter({t: views * c for t, c in collections.Counter(targets).items()})
    if labels.dim() == 2:   # mixup's soft labels: a batch's column sums are its classes' counts
        counts = torch.tensor([want[c] for c in range(labels.shape[1])], dtype=labels.dtype)
        return len(labels) == views * n and bool(torch.allclose(labels.sum(0), counts, atol=1e-2))
    return len(labels) == views * n and not collections.Counter(labels.tolist()) - want


def run(args) -> dict:
    import coordl

    root = common.image_folder(args, "recipes-", **({"image_size": (96, 128), "mean_kb": 6} if args.quick else {}))
    presets = _load_presets(args.presets)
    loaders = {"torch": torch.utils.data.DataLoader, "coordl": coordl.DataLoader}
    acc = None
    if args.accelerate:
        import accelerate

        import coordl.accelerate
        acc = accelerate.Accelerator(cpu=True)
    rows = []
    for rnd in range(args.rounds):
        for recipe in args.recipes:
            order = ["torch", "coordl"] if rnd % 2 == 0 else ["coordl", "torch"]
            seen = {}
            for name in order:
                torch.manual_seed(rnd)
                c0 = _cpu()
                t0 = time.perf_counter()
                ds, loader = build(recipe, root, args.size, presets, loaders[name], args.batch_size, args.workers)
                if acc is not None:
                    keep = name == "coordl" and args.accelerate == "coordl"
                    loader = coordl.accelerate.prepare(acc, loader) if keep else acc.prepare(loader)
                n, once, labels = 0, True, []
                for _epoch in range(args.epochs):
                    count, _sec, lab = common.epoch(loader)
                    n += count
                    labels.append(lab)
                    once = once and _each_once(ds, lab, args.batch_size, recipe in ("timm_ds_train", "timm_ds_augmix", "moco_v2", "dino"),
                                               VIEWS.get(recipe, 1))
                sec = time.perf_counter() - t0
                inner = getattr(loader, "loader", loader)       # timm's PrefetchLoader holds the DataLoader
                path = (lambda s: f"{s.path}: {s.path_reason}")(inner.stats()) \
                    if name == "coordl" and hasattr(inner, "stats") else "torch"
                del inner
                del loader
                if acc is not None:
                    acc.free_memory()       # Accelerate holds every loader it prepared
                gc.collect()
                time.sleep(0.5)     # the workers exit and are reaped: their CPU is then counted
                cpu = _cpu() - c0
                seen[name] = labels
                rows.append({"round": rnd, "recipe": recipe, "loader": name, "images": n, "seconds": round(sec, 3),
                             "images_per_s": round(n / sec, 1), "cpu_ms_per_image": round(1e3 * cpu / n, 2),
                             "every_sample_once": once, "path": path})
                print(f"round {rnd} {recipe:<16} {name:<6} {n:>6} images {sec:>8.2f}s {n / sec:>8.1f} images/s "
                      f"{1e3 * cpu / n:>7.2f} CPU-ms/image once={once}" + (f"\n    {path}" if name == "coordl" else ""),
                      flush=True)
            same = all(torch.equal(a, b) for a, b in zip(seen["torch"], seen["coordl"]))
            rows[-1]["same_labels_as_torch"] = rows[-2]["same_labels_as_torch"] = same
    summary = {}
    for recipe in args.recipes:
        ratios = common.round_ratios(rows, "recipe", recipe, "coordl", "torch")
        cpu = common.round_ratios(rows, "recipe", recipe, "torch", "coordl", "cpu_ms_per_image")
        mine = [x for x in rows if x["recipe"] == recipe]
        summary[recipe] = {"coordl_over_torch": round(statistics.median(ratios), 3),
                           "ratios": [round(r, 3) for r in ratios],
                           "torch_cpu_over_coordl_cpu": round(statistics.median(cpu), 3),
                           "every_sample_once": all(x["every_sample_once"] for x in mine),
                           "same_labels_as_torch": all(x["same_labels_as_torch"] for x in mine),
                           "path": next(x["path"] for x in mine if x["loader"] == "coordl")}
        print(f"{recipe:<16} coordl / torch {summary[recipe]['coordl_over_torch']:.2f}x "
              f"(rounds {summary[recipe]['ratios']}; CPU per image, torch / coordl "
              f"{summary[recipe]['torch_cpu_over_coordl_cpu']:.2f}x), every sample once: "
              f"{summary[recipe]['every_sample_once']}, "
              f"same labels in the same order as torch: {summary[recipe]['same_labels_as_torch']}")
    return {"rows": rows, "summary": summary,
            "settings": {"root": root, "batch_size": args.batch_size, "workers": args.workers, "epochs": args.epochs,
                         "rounds": args.rounds, "size": args.size, "presets": presets[3],
                         "accelerate": args.accelerate,
                         "cpus": os.cpu_count(), "torch": torch.__version__}}


def _tv_decodes() -> bool:
    """Whether torchvision's ``decode_image`` decodes here."""
    import io

    from PIL import Image

    tv = common.torchvision()
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tv.io.decode_image(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    except (RuntimeError, AttributeError):
        return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="ImageFolder root (default: generate one)")
    ap.add_argument("--images", type=int, default=400, help="images to generate when --root is not given")
    ap.add_argument("--presets", default=None, help="a copy of torchvision's references/classification/presets.py")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--accelerate", nargs="?", const="coordl", choices=["coordl", "plain"], default=None,
                    help="each loader prepared by Hugging Face Accelerate: coordl's by coordl.accelerate.prepare "
                         "(coordl, the default), or by accelerator.prepare as torch's (plain)")
    args = ap.parse_args(argv)
    args.recipes = args.recipes.split(",")
    unknown = sorted(set(args.recipes) - set(RECIPES))
    if unknown:
        ap.error(f"--recipes should name recipes among {', '.join(RECIPES)}, but got {', '.join(unknown)}")
    if any(r.startswith("timm") for r in args.recipes) and importlib.util.find_spec("timm") is None:
        print("timm is not installed (pip install timm): its recipes are left out", file=sys.stderr)
        args.recipes = [r for r in args.recipes if not r.startswith("timm")]
    if any(r.startswith("decode_image") for r in args.recipes) and not _tv_decodes():
        print("torchvision's image decoders do not load here: the decode_image recipes are left out", file=sys.stderr)
        args.recipes = [r for r in args.recipes if not r.startswith("decode_image")]
    if args.quick:
        vars(args).update(common.QUICK)
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true but no accelerator.*")
    res = common.run_and_save(run, args, "recipes")
    ok = all(s["every_sample_once"] for s in res["summary"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
