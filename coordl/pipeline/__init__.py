"""The staged pipeline: fetch, prep and collate, and where they run (private).

- ``readahead``: the fetch stage's read-ahead threads (``Fetcher``), within a
  byte budget, along a worker's share of the epoch plan;
- ``prep``: ``prep_sample``, one sample raw -> prepared under its RNG;
- ``engine``: one worker's event loop (fetch -> prep -> collate -> send), and
  where bytes come from (node cache, peer, storage);
- ``collate``, ``slots``: collate straight into a batch slot; memfd slots
  shared with the main process;
- ``workers``: the placements: worker processes (``WorkerPool``,
  ``PipelineIter``) and inline (``InlineIter``, ``num_workers=0``);
- ``worker_process``: what runs inside a worker process (its main loop,
  the watch on the main process, seeding);
- ``torch_path``: adapters that run two-stage datasets on torch's own worker
  machinery;
- ``modes``: how a loader runs its passes (one strategy per mode);
- ``passes``: one pass as the user's loop sees it (counts, times, progress
  bar, torch's iterator attributes).

Nothing here is public API: users reach it through :class:`coordl.DataLoader`.
"""
