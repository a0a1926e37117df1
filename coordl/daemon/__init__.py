"""The node daemon: coordinated prep for concurrent jobs (``share=True``).

One daemon per user per node prepares each sample of a group's plan once,
into shared memory, and every member job assembles its own batches from it.

* :mod:`coordl.daemon.ipc`: the local transport (a per-user Unix socket in a
  private directory, the peer's uid checked on both ends, bounded JSON
  frames that may carry file descriptors);
* :mod:`coordl.daemon.server`: the daemon process and its serve loop;
* :mod:`coordl.daemon.groups`: a group's staging and schedule as plain
  data (the policy: what to keep, whom to detach, what to prepare next);
* :mod:`coordl.daemon.staging`: what a group holds in the kernel (the
  pickled dataset's fd, the staging memfd), below the hub and the pools;
* :mod:`coordl.daemon.pool`: the worker pools (start, set up, feed, watch
  and replace the daemon's worker processes);
* :mod:`coordl.daemon.hub`: groups of jobs and the messages that move
  samples between members, staging and workers (the protocol);
* :mod:`coordl.daemon.codeid`: the code a dataset runs, as one digest (a
  group runs one code);
* :mod:`coordl.daemon.worker`: the prep worker processes;
* :mod:`coordl.daemon.member`: the job's side of sharing (joining, the share mode);
* :mod:`coordl.daemon.shared_iter`: a job's pass over the staged samples
  (batches as views of staging or one copy; detach, rejoin, fallback).
"""
