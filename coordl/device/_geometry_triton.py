"""The Triton kernels of :mod:`.geometry_kernel` (imported only where
Triton imports: this module needs it at import time, since Triton's
compiler resolves a kernel's helpers among its module's names)."""
import triton
import triton.language as tl


@triton.jit
def _record(ints, floats, b):
    # image b's row of the tables (geometry_kernel.BatchGeometry.run): NINT ints, then 6 floats
    ip = ints + b * 15                   # NINT
    fp = floats + b * 6
    return (tl.load(ip + 0), tl.load(ip + 1), tl.load(ip + 2), tl.load(ip + 3), tl.load(ip + 4),
            tl.load(ip + 5), tl.load(ip + 6), tl.load(ip + 7), tl.load(ip + 8), tl.load(ip + 9),
            tl.load(ip + 10), tl.load(ip + 11), tl.load(ip + 12), tl.load(ip + 13), tl.load(ip + 14),
            tl.load(fp + 0), tl.load(fp + 1), tl.load(fp + 2), tl.load(fp + 3), tl.load(fp + 4),
            tl.load(fp + 5))


@triton.jit
def _span(pos, scale, sup, n):
    # the source span of output positions pos (torch's antialiased filter): center = scale * (pos + 0.5),
    # [int(center - support + 0.5), int(center + support + 0.5)) within [0, n); its start, its size, and
    # start - center
    c = scale * (pos.to(tl.float32) + 0.5)
    lo = tl.maximum((c - sup + 0.5).to(tl.int32), 0)
    size = tl.minimum((c + sup + 0.5).to(tl.int32), n) - lo
    return lo, size, lo.to(tl.float32) - c


@triton.jit
def _filter(x, on, CUBIC: tl.constexpr):
    # torch's antialiased filter at x where on, else 0: the triangle (bilinear), or Keys' cubic with
    # a = -0.5 (bicubic), written as torch writes it
    v = tl.abs(x)
    if CUBIC:
        near = ((-0.5 + 2.0) * v - (-0.5 + 3.0)) * v * v + 1.0
        far = ((-0.5 * v - 5.0 * -0.5) * v + 8.0 * -0.5) * v - 4.0 * -0.5
        return tl.where(on & (v < 1.0), near, tl.where(on & (v < 2.0), far, 0.0))
    return tl.where(on & (v < 1.0), 1.0 - v, 0.0)


@triton.jit
def _taps(k, m, size, inv, CUBIC: tl.constexpr):
    # the filter's value at each tap k of each span, [len, KMAX]: filter((k + start - center + 0.5) * inv)
    return _filter((k[None, :] + m[:, None] + 0.5) * inv, k[None, :] < size[:, None], CUBIC)


@triton.jit
def _weights(k, m, size, inv, CUBIC: tl.constexpr):
    # the taps divided by their sum (a span without weight: by 1)
    w = _taps(k, m, size, inv, CUBIC)
    tot = tl.sum(w, axis=1)
    return tl.math.div_rn(w, tl.where(tot != 0.0, tot, 1.0)[:, None])


@triton.jit
def _total(k, m, size, inv, CUBIC: tl.constexpr):
    # the sum of each span's taps (1 where it is 0), which its taps are divided by
    tot = tl.sum(_taps(k, m, size, inv, CUBIC), axis=1)
    return tl.where(tot != 0.0, tot, 1.0)


@triton.jit
def crop_resize(src, ints, floats, out, oh, ow, BLOCK: tl.constexpr, KMAX: tl.constexpr, CUBIC: tl.constexpr):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    (row, base, sc, sy, sx, t1, l1, h, w, rh, rw, t2, l2, kmax, _flip,
     scale_y, scale_x, inv_y, inv_x, sup_y, sup_x) = _record(ints, floats, b)

    offs = blk * BLOCK + tl.arange(0, BLOCK)
    live = offs < oh * ow
    i = offs // ow
    j = offs % ow
    ii = i + t2                          # in the resized image
    jj = j + l2
    inside = live & (ii >= 0) & (ii < rh) & (jj >= 0) & (jj < rw)
    # each axis's span, and its weights over the span, [BLOCK, KMAX] (the rows': their sum, each row's
    # weight made in the loop)
    ymin, ysize, ym = _span(ii, scale_y, sup_y, h)
    xmin, xsize, xm = _span(jj, scale_x, sup_x, w)
    k = tl.arange(0, KMAX)
    wx = _weights(k, xm, xsize, inv_x, CUBIC)
    tot_y = _total(k, ym, ysize, inv_y, CUBIC)
    cols = (l1 + xmin[:, None] + k[None, :]) * sx
    okx = inside[:, None] & (k[None, :] < xsize[:, None])
    acc0 = tl.zeros((BLOCK,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for ky in range(0, kmax):
        on = ky < ysize
        wy = tl.math.div_rn(_filter((ky + ym + 0.5) * inv_y, on, CUBIC), tot_y)
        p = src + base + (t1 + ymin + ky)[:, None] * sy + cols
        ok = okx & on[:, None]
        acc0 += wy * tl.sum(wx * tl.load(p, mask=ok, other=0).to(tl.float32), axis=1)
        acc1 += wy * tl.sum(wx * tl.load(p + sc, mask=ok, other=0).to(tl.float32), axis=1)
        acc2 += wy * tl.sum(wx * tl.load(p + 2 * sc, mask=ok, other=0).to(tl.float32), axis=1)
    o = out + row * (3 * oh * ow) + offs
    tl.store(o, tl.where(inside, acc0, 0.0), mask=live)
    tl.store(o + oh * ow, tl.where(inside, acc1, 0.0), mask=live)
    tl.store(o + 2 * oh * ow, tl.where(inside, acc2, 0.0), mask=live)

@triton.jit
def _tile(oh, ow, t2, l2, rh, rw, BI: tl.constexpr, BJ: tl.constexpr):
    # this program's BI output rows and BJ columns, their places in the resized image, and which of
    # them lie inside it
    i = tl.program_id(1) * BI + tl.arange(0, BI)
    j = tl.program_id(2) * BJ + tl.arange(0, BJ)
    ii = i + t2
    jj = j + l2
    return i, j, ii, jj, (i < oh) & (ii >= 0) & (ii < rh), (j < ow) & (jj >= 0) & (jj < rw)


@triton.jit
def _tile_down(oh, ow, t2, l2, rh, rw, h, scale_y, inv_y, sup_y, BI: tl.constexpr, BJ: tl.constexpr,
               KMAX: tl.constexpr, CUBIC: tl.constexpr):
    # _tile's rows and columns, and each row's span down the column: its start, size, start - center
    # and the sum of its taps [BI]
    i, j, ii, jj, in_i, in_j = _tile(oh, ow, t2, l2, rh, rw, BI, BJ)
    ymin, ysize, ym = _span(ii, scale_y, sup_y, h)
    return i, j, jj, in_i, in_j, ymin, ysize, ym, _total(tl.arange(0, KMAX), ym, ysize, inv_y, CUBIC)


@triton.jit
def _columns(jj, in_j, l1, sx, scale_x, inv_x, sup_x, w, KMAX: tl.constexpr, CUBIC: tl.constexpr):
    # each column's span along the row: its weights [BJ, KMAX], its taps' offsets in a source row, and
    # which taps are read
    xmin, xsize, xm = _span(jj, scale_x, sup_x, w)
    k = tl.arange(0, KMAX)
    cols = (l1 + xmin[:, None] + k[None, :]) * sx
    return _weights(k, xm, xsize, inv_x, CUBIC), cols, in_j[:, None] & (k[None, :] < xsize[:, None])


@triton.jit
def _along(p, ok, wx, sc):
    # each channel's sums along the source rows at p ([rows, BJ, KMAX] taps): [rows, BJ] each
    s0 = tl.sum(wx[None, :, :] * tl.load(p, mask=ok, other=0).to(tl.float32), axis=2)
    s1 = tl.sum(wx[None, :, :] * tl.load(p + sc, mask=ok, other=0).to(tl.float32), axis=2)
    s2 = tl.sum(wx[None, :, :] * tl.load(p + 2 * sc, mask=ok, other=0).to(tl.float32), axis=2)
    return s0, s1, s2


@triton.jit
def _down(ky, ym, ysize, in_i, inv_y, tot_y, CUBIC: tl.constexpr):
    # tap ky of each output row's span down the column: its weight [BI], and which rows have it
    on = in_i & (ky < ysize)
    return tl.math.div_rn(_filter((ky + ym + 0.5) * inv_y, on, CUBIC), tot_y), on


@triton.jit
def crop_resize_tiles(src, ints, floats, out, oh, ow, norm, BI: tl.constexpr, BJ: tl.constexpr,
                      KMAX: tl.constexpr, FINAL: tl.constexpr, NORM: tl.constexpr, CUBIC: tl.constexpr):
    # the same sums as crop_resize, a tile of BI output rows by BJ columns per program: each column's
    # horizontal weights and each row's vertical ones computed once for the tile, not per pixel
    b = tl.program_id(0)
    (row, base, sc, sy, sx, t1, l1, h, w, rh, rw, t2, l2, kmax, flip,
     scale_y, scale_x, inv_y, inv_x, sup_y, sup_x) = _record(ints, floats, b)

    i, j, jj, in_i, in_j, ymin, ysize, ym, tot_y = _tile_down(oh, ow, t2, l2, rh, rw, h, scale_y, inv_y, sup_y,
                                                            BI, BJ, KMAX, CUBIC)
    wx, cols, okx = _columns(jj, in_j, l1, sx, scale_x, inv_x, sup_x, w, KMAX, CUBIC)     # [BJ, KMAX]
    acc0 = tl.zeros((BI, BJ), dtype=tl.float32)
    acc1 = tl.zeros((BI, BJ), dtype=tl.float32)
    acc2 = tl.zeros((BI, BJ), dtype=tl.float32)
    for ky in range(0, kmax):
        wy, on = _down(ky, ym, ysize, in_i, inv_y, tot_y, CUBIC)
        p = src + base + ((t1 + ymin + ky) * sy)[:, None, None] + cols[None, :, :]
        s0, s1, s2 = _along(p, on[:, None, None] & okx[None, :, :], wx, sc)
        acc0 += wy[:, None] * s0
        acc1 += wy[:, None] * s1
        acc2 += wy[:, None] * s2
    _store(acc0, acc1, acc2, in_i, in_j, i, j, out, row, oh, ow, flip, norm, BI, BJ, FINAL, NORM)


@triton.jit
def _store(acc0, acc1, acc2, in_i, in_j, i, j, out, row, oh, ow, flip, norm, BI: tl.constexpr, BJ: tl.constexpr,
           FINAL: tl.constexpr, NORM: tl.constexpr):
    # a tile's sums into its row of the batch: float32 as they are (FINAL 0), or rounded, clamped and
    # mirrored as uint8 (1), or those through the tail's arithmetic as float32 (2)
    inside = in_i[:, None] & in_j[None, :]
    live = (i < oh)[:, None] & (j < ow)[None, :]
    plane = oh * ow
    if FINAL == 0:
        o = out + row * (3 * plane) + i[:, None] * ow + j[None, :]
        tl.store(o, tl.where(inside, acc0, 0.0), mask=live)
        tl.store(o + plane, tl.where(inside, acc1, 0.0), mask=live)
        tl.store(o + 2 * plane, tl.where(inside, acc2, 0.0), mask=live)
    else:
        # rounded half to even (adding and taking away 1.5 * 2**23 leaves the nearest integer, ties to
        # even, for the values a resize of uint8 gives), clamped, mirrored where the record flips
        jo = tl.where(flip != 0, ow - 1 - j, j)
        o = out + row * (3 * plane) + i[:, None] * ow + jo[None, :]
        r0 = tl.minimum(tl.maximum((tl.where(inside, acc0, 0.0) + 12582912.0) - 12582912.0, 0.0), 255.0)
        r1 = tl.minimum(tl.maximum((tl.where(inside, acc1, 0.0) + 12582912.0) - 12582912.0, 0.0), 255.0)
        r2 = tl.minimum(tl.maximum((tl.where(inside, acc2, 0.0) + 12582912.0) - 12582912.0, 0.0), 255.0)
        if FINAL == 1:      # the uint8 rows
            tl.store(o, r0.to(tl.uint8), mask=live)
            tl.store(o + plane, r1.to(tl.uint8), mask=live)
            tl.store(o + 2 * plane, r2.to(tl.uint8), mask=live)
        else:               # the device tail's float rows: / 255, then (x - mean) / std, IEEE divisions
            zero = tl.zeros((BI, BJ), dtype=tl.float32)         # divisors as whole tiles, as div_rn takes them
            c255 = zero + 255.0
            x0 = tl.math.div_rn(r0, c255)
            x1 = tl.math.div_rn(r1, c255)
            x2 = tl.math.div_rn(r2, c255)
            if NORM:
                x0 = tl.math.div_rn(x0 - tl.load(norm + 0), zero + tl.load(norm + 3))
                x1 = tl.math.div_rn(x1 - tl.load(norm + 1), zero + tl.load(norm + 4))
                x2 = tl.math.div_rn(x2 - tl.load(norm + 2), zero + tl.load(norm + 5))
            tl.store(o, x0, mask=live)
            tl.store(o + plane, x1, mask=live)
            tl.store(o + 2 * plane, x2, mask=live)


@triton.jit
def row_sums(src, ints, floats, mids, mid, ow, BR: tl.constexpr, BJ: tl.constexpr, KMAX: tl.constexpr,
             CUBIC: tl.constexpr):
    # the separable kernels' first pass: for BR rows of image b's crop and BJ output columns, each
    # channel's sum along the row (the horizontal weights, as crop_resize_tiles computes them), into
    # the image's (3, crop height, ow) float32 block of ``mid`` (at ``mids[b]``)
    b = tl.program_id(0)
    (row, base, sc, sy, sx, t1, l1, h, w, rh, rw, t2, l2, kmax, flip,
     scale_y, scale_x, inv_y, inv_x, sup_y, sup_x) = _record(ints, floats, b)

    r, j, _rr, jj, in_r, in_j = _tile(h, ow, 0, l2, h, rw, BR, BJ)
    wx, cols, okx = _columns(jj, in_j, l1, sx, scale_x, inv_x, sup_x, w, KMAX, CUBIC)     # [BJ, KMAX]
    p = src + base + ((t1 + r) * sy)[:, None, None] + cols[None, :, :]
    s0, s1, s2 = _along(p, in_r[:, None, None] & okx[None, :, :], wx, sc)
    plane = h * ow
    m = mid + tl.load(mids + b) + r[:, None] * ow + j[None, :]
    live = in_r[:, None] & (j < ow)[None, :]
    tl.store(m, s0, mask=live)
    tl.store(m + plane, s1, mask=live)
    tl.store(m + 2 * plane, s2, mask=live)


@triton.jit
def column_sums(mid, mids, ints, floats, out, oh, ow, norm, BI: tl.constexpr, BJ: tl.constexpr,
                KMAX: tl.constexpr, FINAL: tl.constexpr, NORM: tl.constexpr, CUBIC: tl.constexpr):
    # the separable kernels' second pass: a tile of BI output rows by BJ columns, each the sum down its
    # span of row_sums' rows with the vertical weights, then stored as crop_resize_tiles stores (the same
    # products added in the same order as there, which sums each row's span inside its loop)
    b = tl.program_id(0)
    (row, base, sc, sy, sx, t1, l1, h, w, rh, rw, t2, l2, kmax, flip,
     scale_y, scale_x, inv_y, inv_x, sup_y, sup_x) = _record(ints, floats, b)

    i, j, jj, in_i, in_j, ymin, ysize, ym, tot_y = _tile_down(oh, ow, t2, l2, rh, rw, h, scale_y, inv_y, sup_y,
                                                            BI, BJ, KMAX, CUBIC)
    plane = h * ow
    m = mid + tl.load(mids + b) + j[None, :]
    acc0 = tl.zeros((BI, BJ), dtype=tl.float32)
    acc1 = tl.zeros((BI, BJ), dtype=tl.float32)
    acc2 = tl.zeros((BI, BJ), dtype=tl.float32)
    for ky in range(0, kmax):
        wy, on = _down(ky, ym, ysize, in_i, inv_y, tot_y, CUBIC)
        q = m + ((ymin + ky) * ow)[:, None]
        ok = on[:, None] & in_j[None, :]
        acc0 += wy[:, None] * tl.load(q, mask=ok, other=0.0)
        acc1 += wy[:, None] * tl.load(q + plane, mask=ok, other=0.0)
        acc2 += wy[:, None] * tl.load(q + 2 * plane, mask=ok, other=0.0)
    _store(acc0, acc1, acc2, in_i, in_j, i, j, out, row, oh, ow, flip, norm, BI, BJ, FINAL, NORM)
