"""Erasing cases two test modules share: a float batch, each row's
RandomErasing rectangles (up to 4 a row, overlapping, at the edges), and the
batch as torchvision's erase of each rectangle in turn leaves it."""
import random

import torch


def case(value, b=9, h=13, w=17, seed=5):
    """``(y, rows, want)``: ``rows[j]`` row ``j``'s rectangles."""
    rnd = random.Random(seed)
    y = torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(seed))
    want = y.clone()
    v = torch.tensor(value, dtype=torch.float32).view(-1, 1, 1)
    rows = []
    for i in range(b):
        rects = []
        for _ in range(rnd.choice([0, 1, 1, 2, 4])):
            eh, ew = rnd.randint(1, h - 1), rnd.randint(1, w - 1)
            rects.append((rnd.randint(0, h - eh), rnd.randint(0, w - ew), eh, ew))
        rows.append(rects)
        for t, l, eh, ew in rects:
            want[i, :, t:t + eh, l:l + ew] = v
    return y, rows, want
