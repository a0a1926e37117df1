"""Training steps for benchmarks/analyze_validate.py, importable by the
analyzer (``step="benchmarks/_anval_steps.py:cpu_step"``) and by the
benchmark's own training loops.

* :func:`cpu_step`: one SGD step of a small CNN on the CPU (torch's default
  intra-op threads: it competes with the loader's workers for the cores);
* :class:`SleepStep`: a step that sleeps ``batch / rate`` seconds, as a host
  waiting for an accelerator does (no CPU).
"""
from __future__ import annotations

import time

import torch

_state: dict = {}


def _net():
    if not _state:
        g = torch.Generator().manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 7, stride=4), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        _state["net"] = net
        _state["opt"] = torch.optim.SGD(net.parameters(), lr=0.01)
    return _state["net"], _state["opt"]


def cpu_step(batch) -> None:
    """Forward, backward and an SGD update of a small CNN on the batch's images."""
    net, opt = _net()
    x, y = batch[0], batch[1]
    if x.dtype != torch.float32:
        x = x.float().div_(255)
    loss = torch.nn.functional.cross_entropy(net(x), y % 10)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


class SleepStep:
    """``batch / rate`` seconds of sleep per batch: an accelerator-like step."""

    def __init__(self, rate: float):
        self.rate = float(rate)

    def __call__(self, batch) -> None:
        time.sleep(len(batch[1]) / self.rate)
