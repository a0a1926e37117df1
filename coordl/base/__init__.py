"""Process-wide helpers every layer stands on (private: nothing here is public API).

- ``reaper``: the one thread that runs the clean-ups finalizers enqueue
  (stopping a dropped pool's workers, a collected loader's cache detach);
- ``units``: ``parse_size`` for sizes given as ``"16GiB"`` or ``"10%"``;
- ``forks``: what happens around a fork: ``starting_workers``, around the
  code that forks worker processes, so a worker never collects (and so never
  destroys) an object it inherited, a CUDA tensor in the parent's garbage
  above all; and the at-fork hook that keeps a zero-copy batch's bytes in a
  forked child (the pipeline retires its slots, sharing gives its views
  private pages);
- ``foreign``: other libraries' classes (torchvision's folders, timm's
  dataset) recognized by module and name, and why one cannot be read as
  raw bytes + prep.

They import nothing of coordl, so the cache, the pipeline, the device path
and the loader can all use them without an import running up a layer.
"""
