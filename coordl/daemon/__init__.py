"""The node daemon (coordinated prep across jobs): work in progress.

What exists so far is the local transport every part of it will use
(:mod:`coordl.daemon.ipc`): a per-user Unix socket in a private directory,
the peer's uid checked on both ends, and bounded JSON frames that may carry
file descriptors.  Nothing in the loader uses it yet.
"""
