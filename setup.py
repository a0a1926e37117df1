"""Build step for coordl's one optional C extension; metadata lives in setup.cfg.

``coordl.decode._jpegcrop`` decodes only the crop window of a JPEG through the
system libjpeg(-turbo) (Debian: libjpeg62-turbo-dev).  It is optional: on a
machine without a C compiler or the libjpeg headers the build of it fails
quietly, the package still installs, and coordl decodes whole images with
simplejpeg as before.
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("coordl.decode._jpegcrop", ["coordl/decode/_jpegcrop.c"], libraries=["jpeg"], optional=True,
              extra_compile_args=["-O2", "-std=c99"]),
])
