"""The Triton kernel of :mod:`.jitter` (imported only where Triton imports).

One launch applies one colour operation to each of its rows of a uint8
(B, 3, H, W) batch, in place: program (k, blk) takes ``BLOCK`` pixels of
row ``rows[k]`` and that row's operation (``codes[k]``: 0 brightness, 1
contrast, 2 saturation, 3 hue; ``alphas[k]`` the factor in single
precision, ``bases[k]`` the grey level a brightness or contrast blends
with, ``shifts[k]`` the hue turn).  ``luma_sums`` takes contrast's sums
first.  Launched with ``enable_fp_fusion=False``:
PIL's blend rounds its product and its sum apart, which a fused
multiply-add would not."""
import triton
import triton.language as tl


@triton.jit
def _blend(a, v, alpha):
    # PIL's blend of the int32 values v with the float32 a: a + alpha * (v - a), clipped, truncated
    t = a + alpha * (v.to(tl.float32) - a)
    return tl.floor(tl.minimum(tl.maximum(t, 0.0), 255.0)).to(tl.int32)


@triton.jit
def _pixels(y, rows, hw, BLOCK: tl.constexpr):
    # program (k, blk)'s pixels of row rows[k]: the first plane's pointers, which are live, the three values
    k = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < hw
    p0 = y + tl.load(rows + k) * 3 * hw + offs
    c0 = tl.load(p0, mask=live, other=0).to(tl.int32)
    c1 = tl.load(p0 + hw, mask=live, other=0).to(tl.int32)
    c2 = tl.load(p0 + 2 * hw, mask=live, other=0).to(tl.int32)
    return p0, live, c0, c1, c2


@triton.jit
def _luma(c0, c1, c2):
    # PIL's RGB -> L (0 where nothing was loaded)
    return (c0 * 19595 + c1 * 38470 + c2 * 7471 + 0x8000) >> 16


@triton.jit
def jitter_ops(y, rows, codes, alphas, bases, shifts, hw, to_hsv, from_hsv, BLOCK: tl.constexpr):
    k = tl.program_id(0)
    code = tl.load(codes + k)
    p0, live, c0, c1, c2 = _pixels(y, rows, hw, BLOCK)
    if code == 3:
        # PIL's RGB -> HSV and HSV -> RGB, as tables of every colour; the hue turned between
        hsv = tl.load(to_hsv + ((c0 << 16) | (c1 << 8) | c2), mask=live, other=0)
        turned = (((hsv >> 16) + tl.load(shifts + k)) & 255) << 16
        rgb = tl.load(from_hsv + (turned | (hsv & 0xFFFF)), mask=live, other=0)
        o0 = (rgb >> 16) & 255
        o1 = (rgb >> 8) & 255
        o2 = rgb & 255
    else:
        alpha = tl.load(alphas + k)
        if code == 2:
            # each value blended with its pixel's luma (PIL's RGB -> L)
            a = _luma(c0, c1, c2).to(tl.float32)
        else:
            a = tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(bases + k)
        o0 = _blend(a, c0, alpha)
        o1 = _blend(a, c1, alpha)
        o2 = _blend(a, c2, alpha)
    tl.store(p0, o0.to(tl.uint8), mask=live)
    tl.store(p0 + hw, o1.to(tl.uint8), mask=live)
    tl.store(p0 + 2 * hw, o2.to(tl.uint8), mask=live)


@triton.jit
def luma_sums(y, rows, sums, hw, BLOCK: tl.constexpr):
    # the sum of PIL's luma over row rows[k] of the uint8 batch y, added into sums[k] (int64: exact in any order)
    _, _, c0, c1, c2 = _pixels(y, rows, hw, BLOCK)
    tl.atomic_add(sums + tl.program_id(0), tl.sum(_luma(c0, c1, c2).to(tl.int64), axis=0))
