"""The node daemon: coordinated prep for concurrent jobs (``share=True``).

One daemon per user per node prepares each sample of a group's plan once,
into shared memory, and every member job assembles its own batches from it.

* :mod:`coordl.daemon.ipc`: the local transport (a per-user Unix socket in a
  private directory, the peer's uid checked on both ends, bounded JSON
  frames that may carry file descriptors);
* :mod:`coordl.daemon.server`: the daemon process and its serve loop;
* :mod:`coordl.daemon.hub` and :mod:`coordl.daemon.groups`: groups of jobs
  and their staging memory (protocol and policy);
* :mod:`coordl.daemon.pool`: the hub's worker pools (start, set up, feed,
  watch and replace the daemon's worker processes);
* :mod:`coordl.daemon.worker`: the prep worker processes;
* :mod:`coordl.daemon.member`: the job's side of sharing (joining, the share mode);
* :mod:`coordl.daemon.shared_iter`: a job's pass over the staged samples
  (batches as views of staging or one copy; detach, rejoin, fallback).
"""
