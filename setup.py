"""Build step for coordl's optional C extensions; metadata lives in setup.cfg.

``coordl.decode._jpegcrop`` decodes only the crop window of a JPEG through the
system libjpeg(-turbo) (Debian: libjpeg62-turbo-dev).  It is optional: on a
machine without a C compiler or the libjpeg headers the build of it fails
quietly, the package still installs, and coordl decodes whole images with
simplejpeg as before.

``coordl.decode._resample`` resamples uint8 images with PIL's arithmetic (the
fused path's Resize and RandomResizedCrop).  It needs only a C compiler;
without it the fused path has PIL resample instead (the same pixels, slower).

``coordl.decode._color`` computes PIL's brightness, contrast, saturation and
hue adjustments (torchvision's ``ColorJitter`` on a PIL image) on the fused
path's planes.  It needs only a C compiler; without it they run through PIL.

``coordl.decode._draws`` makes ``RandomResizedCrop``'s and a flip's draws for
a batch of samples, each from its own (seed, epoch, index) generator, as
Python's ``random`` makes them (``decode="device"``'s batch path).  It needs
only a C compiler; without it (or where its draws differ from this Python's)
the draws are made in Python.
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("coordl.decode._jpegcrop", ["coordl/decode/_jpegcrop.c"], libraries=["jpeg"], optional=True,
              extra_compile_args=["-O2", "-std=c99"]),
    # -ffp-contract=off: the weights are computed as written (no fused multiply-add), as PIL computes them
    Extension("coordl.decode._resample", ["coordl/decode/_resample.c"], optional=True,
              extra_compile_args=["-O3", "-std=c99", "-ffp-contract=off"]),
    # -ffp-contract=off: PIL's blend and HSV expressions round after each operation
    Extension("coordl.decode._color", ["coordl/decode/_color.c"], optional=True,
              extra_compile_args=["-O3", "-std=c99", "-ffp-contract=off"]),
    # -ffp-contract=off: the draws' expressions round after each operation, as Python's floats do
    Extension("coordl.decode._draws", ["coordl/decode/_draws.c"], optional=True, libraries=["m"],
              extra_compile_args=["-O2", "-std=c99", "-ffp-contract=off"]),
])
