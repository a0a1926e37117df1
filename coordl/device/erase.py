"""``RandomErasing``'s rectangles set on a batch on the device, after the
conversion (``decode="device"``'s stage and the device split's tail): each
row's rectangles, drawn in the worker as the CPU path draws them, set to the
erasing's value as torchvision's ``erase`` sets them (the float32 value per
channel, written as it is), so the erased pixels are the CPU path's bytes.

A few rectangles, or on a device that is the CPU (where each copy is the
work itself): a copy each.  More on a GPU (at torchvision's default
``p=0.5``, half the rows have one): the batch's mask of erased pixels, made
on the device from the rectangles, then one masked fill per channel, a fixed
handful of launches where a copy each would be a launch each (the host's
time per launch, about 10 us, is what the pin thread spends)."""
from __future__ import annotations

import numpy as np
import torch

from .launch import upload

__all__ = ["erase_rows", "value_on", "FEW_RECTS", "MASK_DEVICES"]

#: at most this many rectangles in a batch are set a copy each, more through a mask on the devices of
#: MASK_DEVICES (on the CPU a copy each is cheaper: three passes over the batch are not)
FEW_RECTS = 8
MASK_DEVICES = ("cuda",)


def value_on(value, device: torch.device) -> torch.Tensor:
    """The erasing's value (one per channel, or one for all) as a float32
    (C, 1, 1) tensor on ``device``, copied without a wait."""
    return upload(np.asarray(value, dtype=np.float32).reshape(-1, 1, 1), device)


def erase_rows(y: torch.Tensor, rows: list, value: torch.Tensor | None, noise: list | None = None) -> torch.Tensor:
    """``y`` (B, C, H, W) with row ``j``'s rectangles ``rows[j]`` (``[(top,
    left, height, width)]``) set to ``value`` (:func:`value_on`), in place;
    with ``noise`` (an erasing of noise), rectangle ``q`` of row ``j`` set
    to ``noise[j][q]`` instead ((C, height, width), or (C, 1, 1) for one
    value per channel, on ``y``'s device): a copy each."""
    rects = [(j, *rect) for j, rs in enumerate(rows) for rect in rs]
    if not rects:
        return y
    if noise is not None:
        for j, rs in enumerate(rows):
            for (top, left, h, w), v in zip(rs, noise[j]):
                y[j, :, top:top + h, left:left + w] = v
        return y
    if len(rects) <= FEW_RECTS or y.device.type not in MASK_DEVICES:
        for j, top, left, h, w in rects:
            y[j, :, top:top + h, left:left + w] = value
        return y
    mask = torch.zeros(y.shape[0], y.shape[2], y.shape[3], dtype=torch.bool, device=y.device)
    ys = torch.arange(y.shape[2], device=y.device)
    xs = torch.arange(y.shape[3], device=y.device)
    # the rows' first rectangles, then their second ones...: within a round each row once (no atomics)
    rounds: dict = {}
    seen: dict = {}
    for rect in rects:
        q = seen[rect[0]] = seen.get(rect[0], -1) + 1
        rounds.setdefault(q, []).append(rect)
    for q in sorted(rounds):
        r = upload(np.asarray(rounds[q], dtype=np.int64), y.device)
        j, top, left = r[:, 0], r[:, 1:2], r[:, 2:3]
        inside = ((ys >= top) & (ys < top + r[:, 3:4]))[:, :, None] & \
                 ((xs >= left) & (xs < left + r[:, 4:5]))[:, None, :]
        mask[j] = inside if q == 0 else mask[j] | inside
    v = value.view(-1)
    if v.numel() == 1:
        y.masked_fill_(mask[:, None], v[0])
    else:
        for c in range(y.shape[1]):
            y[:, c].masked_fill_(mask, v[c])
    return y
