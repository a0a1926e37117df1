"""Image decode: the JPEG fast path the fused transforms use (private).

- ``jpeg``: libjpeg-turbo decode through simplejpeg with PIL's limits
  (truncated files, decompression bombs), crop-window decode for
  RandomResizedCrop, and the reduced-scale decode of the ``draft`` option;
- ``_jpegcrop``: the optional C extension (``_jpegcrop.c``, built by
  ``setup.py``) that decodes only a crop window; the leading underscore is
  Python's convention for a compiled helper behind a pure-Python front
  (``jpeg``); without it RandomResizedCrop decodes whole images.
- ``resample`` and the optional C extension ``_resample`` (``_resample.c``):
  PIL's resampling arithmetic on numpy arrays, bit for bit, which the fused
  decode runs for a resize torchvision would run on a PIL image (PIL itself
  where the extension is missing or does not reproduce the installed PIL);
- ``color`` and the optional C extension ``_color`` (``_color.c``): PIL's
  brightness, contrast, saturation and hue arithmetic on uint8 planes, bit
  for bit (torchvision's ``ColorJitter`` on the fused path's planes; PIL
  itself where the extension is missing or does not reproduce the installed
  PIL);
- ``ops``: the image operations the transforms and the fused decode run
  (resize, crop, RandomResizedCrop's box draw, HWC -> CHW, the resampling
  filters) and their argument checks;
- ``loaders``: the folder datasets' path loaders and byte decoder
  (``read_bytes``, ``pil_decode``, ``pil_loader``, ``default_loader``).
- ``verify``: ``coordl verify``, the JPEG files whose entropy-coded data
  ends early or is corrupt (which a GPU decoder decodes only in part);
- ``extensions``: what the three fronts share about their optional
  extension: loading it (None where it was not built) and running the
  check against the installed PIL once per process.

Users reach this through :mod:`coordl.transforms` and :mod:`coordl.datasets`.
"""
