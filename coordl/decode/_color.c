/* coordl.decode._color: PIL's colour adjustments of 8-bit images
 * (ImageEnhance's Brightness, Contrast and Color, and a hue rotation through
 * PIL's HSV conversion), on image planes, without a PIL image in between.
 *
 * jitter(src, out, ops) -> None
 *
 * src: a C-contiguous uint8 array (C, H, W), C 1 (mode L) or 3 (mode RGB);
 * out: a writable C-contiguous uint8 array of the same shape (it may be src).
 * ops: a sequence of (code, value) pairs applied in order, each to the result
 * of the one before:
 *   (0, factor)  brightness: PIL's blend of a black image and the image;
 *   (1, factor)  contrast: the blend of a grey image at the mean luma of the
 *                image (as it is at that step) and the image;
 *   (2, factor)  saturation: the blend of the image's luma and the image
 *                (nothing on mode L, where the two are the same image);
 *   (3, shift)   hue: RGB -> HSV, H + shift (mod 256), HSV -> RGB, with
 *                PIL's conversions (nothing on mode L).
 *
 * The arithmetic is PIL's, bit for bit:
 * - blend(a, b, alpha) = a + alpha * (b - a) in single precision, the
 *   factor rounded to float first, clipped to 0..255 and truncated;
 * - luma = (19595 R + 38470 G + 7471 B + 0x8000) >> 16 (ITU-R 601-2 in
 *   16-bit fixed point), PIL's RGB -> L;
 * - the mean luma is the histogram's sum over the pixel count in double
 *   precision, rounded half up to an integer;
 * - RGB -> HSV and back are PIL's conversions (colorsys' formulas with PIL's
 *   mix of float and double precision and its roundings).
 * pil_op(src, out, code, value) -> None: ImageEnhance.Sharpness (4), and the
 * ImageOps tables posterize (5), solarize (6), autocontrast (7), equalize (8),
 * invert (9) and timm's solarize-add (12), into out (apart from src);
 * transform(src, out, coeffs, filter, fill) -> None: Image.transform with an
 * affine map (six coefficients) or a perspective one (eight), PIL's nearest
 * (its scale, 16.16 fixed-point and double-precision ways), bilinear or
 * bicubic filter in double precision, fill outside (None: zeros).
 *
 * coordl/decode/color.py checks this against the installed PIL when first
 * used (built with -ffp-contract=off: no fused multiply-add where PIL's
 * expressions round twice).  The GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TARGETS __attribute__((target_clones("avx2", "default")))
#else
#define TARGETS
#endif

#define MAX_OPS 16

/* PIL's blend of one value: a + alpha * (b - a) in float, clipped, truncated. */
static inline uint8_t blend_value(int a, int b, float alpha) {
    float t = (float)a + alpha * (float)(b - a);
    t = t < 0.0f ? 0.0f : t;
    t = t > 255.0f ? 255.0f : t;
    return (uint8_t)(int)t;
}

static inline int luma(int r, int g, int b) {
    return (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16;
}

/* out[i] = tab[src[i]] for n values, src and out apart */
TARGETS static void table_apart(uint8_t *restrict out, const uint8_t *restrict src, Py_ssize_t n,
                                const uint8_t *restrict tab) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = tab[src[i]];
}

/* p[i] = tab[p[i]] for n values */
TARGETS static void table_in_place(uint8_t *restrict p, Py_ssize_t n, const uint8_t *restrict tab) {
    for (Py_ssize_t i = 0; i < n; i++)
        p[i] = tab[p[i]];
}

static void apply_table(uint8_t *out, const uint8_t *src, Py_ssize_t n, const uint8_t *tab) {
    if (out == src)
        table_in_place(out, n, tab);
    else
        table_apart(out, src, n, tab);
}

/* the table of blend(a, v, alpha) over v: a blend with a constant image is a function of the value */
static void blend_table(uint8_t *tab, int a, float alpha) {
    for (int v = 0; v < 256; v++)
        tab[v] = blend_value(a, v, alpha);
}

/* sums in blocks of 2**16 values or fewer, each of which fits 32 bits */
#define BLOCK 65536

TARGETS static int64_t luma_sum(const uint8_t *r, const uint8_t *g, const uint8_t *b, Py_ssize_t n) {
    int64_t sum = 0;
    for (Py_ssize_t i0 = 0; i0 < n; i0 += BLOCK) {
        Py_ssize_t i1 = n - i0 < BLOCK ? n : i0 + BLOCK;
        uint32_t part = 0;
        for (Py_ssize_t i = i0; i < i1; i++)
            part += (uint32_t)luma(r[i], g[i], b[i]);
        sum += part;
    }
    return sum;
}

TARGETS static int64_t plane_sum(const uint8_t *p, Py_ssize_t n) {
    int64_t sum = 0;
    for (Py_ssize_t i0 = 0; i0 < n; i0 += BLOCK) {
        Py_ssize_t i1 = n - i0 < BLOCK ? n : i0 + BLOCK;
        uint32_t part = 0;
        for (Py_ssize_t i = i0; i < i1; i++)
            part += p[i];
        sum += part;
    }
    return sum;
}

/* saturation of up to CHUNK pixels of RGB planes into separate buffers: each
 * value blended with its pixel's luma */
#define CHUNK 2048

TARGETS static void saturate_chunk(uint8_t *restrict o0, uint8_t *restrict o1, uint8_t *restrict o2,
                                   const uint8_t *restrict s0, const uint8_t *restrict s1,
                                   const uint8_t *restrict s2, int n, float alpha) {
    for (int i = 0; i < n; i++) {
        int r = s0[i], g = s1[i], b = s2[i];
        int l = luma(r, g, b);
        float fl = (float)l;
        float tr = fl + alpha * (float)(r - l);
        float tg = fl + alpha * (float)(g - l);
        float tb = fl + alpha * (float)(b - l);
        tr = tr < 0.0f ? 0.0f : tr;
        tg = tg < 0.0f ? 0.0f : tg;
        tb = tb < 0.0f ? 0.0f : tb;
        tr = tr > 255.0f ? 255.0f : tr;
        tg = tg > 255.0f ? 255.0f : tg;
        tb = tb > 255.0f ? 255.0f : tb;
        o0[i] = (uint8_t)(int)tr;
        o1[i] = (uint8_t)(int)tg;
        o2[i] = (uint8_t)(int)tb;
    }
}

/* the same over n pixels; the outputs may be the inputs (through a chunk buffer) */
static void saturate(uint8_t *o0, uint8_t *o1, uint8_t *o2, const uint8_t *s0, const uint8_t *s1,
                     const uint8_t *s2, Py_ssize_t n, float alpha) {
    uint8_t buf[3][CHUNK];
    for (Py_ssize_t i0 = 0; i0 < n; i0 += CHUNK) {
        int m = n - i0 < CHUNK ? (int)(n - i0) : CHUNK;
        saturate_chunk(buf[0], buf[1], buf[2], s0 + i0, s1 + i0, s2 + i0, m, alpha);
        memcpy(o0 + i0, buf[0], (size_t)m);
        memcpy(o1 + i0, buf[1], (size_t)m);
        memcpy(o2 + i0, buf[2], (size_t)m);
    }
}

static inline int clip8(int v) { return v <= 0 ? 0 : v < 256 ? v : 255; }

/* fmod(x, 1.0), floor(x) and round(x) for 0 <= x < 2**31, inline and exact:
 * x minus its integer part is exact in binary floating point */
static inline double frac_pos(double x) { return x - (double)(int)x; }
static inline int floor_pos(double x) { return (int)x; }
static inline int round_pos(double x) {
    int i = (int)x;
    return x - (double)i >= 0.5 ? i + 1 : i;  /* halves away from zero, as round() */
}

/* PIL's RGB -> HSV (colorsys' formulas, PIL's precisions) of m pixels.
 * Written without branches so that it vectorizes: every lane computes every
 * candidate (a grey pixel with a stand-in span of 1), then selects; the
 * values selected are those of PIL's branches. */
TARGETS static void to_hsv(uint8_t *restrict H, uint8_t *restrict S, uint8_t *restrict V,
                           const uint8_t *restrict s0, const uint8_t *restrict s1,
                           const uint8_t *restrict s2, int m) {
    for (int i = 0; i < m; i++) {
        int r = s0[i], g = s1[i], b = s2[i];
        int mx = r > g ? r : g;
        mx = mx > b ? mx : b;
        int mn = r < g ? r : g;
        mn = mn < b ? mn : b;
        int grey = mx == mn;
        float span = (float)(grey ? 1 : mx - mn);
        float s = span / (float)(grey ? 1 : mx);
        float rc = (float)(mx - r) / span;
        float gc = (float)(mx - g) / span;
        float bc = (float)(mx - b) / span;
        float h1 = bc - gc;
        float h2 = (float)(2.0 + rc - bc);
        float h3 = (float)(4.0 + gc - rc);
        float h = r == mx ? h1 : (g == mx ? h2 : h3);
        h = (float)frac_pos(h / 6.0 + 1.0);  /* fmod(, 1.0) of a value in (0.8, 1.9) */
        int hh = clip8((int)(h * 255.0));
        int ss = clip8((int)(s * 255.0));
        H[i] = (uint8_t)(grey ? 0 : hh);
        S[i] = (uint8_t)(grey ? 0 : ss);
        V[i] = (uint8_t)mx;
    }
}

/* PIL's HSV -> RGB of m pixels, the hue turned by `shift` first; branch-free
 * as to_hsv */
TARGETS static void from_hsv(uint8_t *restrict o0, uint8_t *restrict o1, uint8_t *restrict o2,
                             const uint8_t *restrict H, const uint8_t *restrict S,
                             const uint8_t *restrict V, int m, int shift) {
    for (int i = 0; i < m; i++) {
        int h = (H[i] + shift) & 255, s = S[i], v = V[i];
        double hd = (float)h * 6.0 / 255.0;
        int sector = floor_pos(hd);  /* 0..6 */
        float f = (float)(hd - (float)sector);
        float fs = (float)((float)s / 255.0);
        float fsf = fs * f;
        int p = clip8(round_pos((float)v * (1.0 - fs)));  /* all three in [0, 255] */
        int q = clip8(round_pos((float)v * (1.0 - fsf)));
        int t = clip8(round_pos((float)v * (1.0 - fs * (1.0 - f))));
        int k = sector == 6 ? 0 : sector;
        /* sectors 0..5: (v,t,p) (q,v,p) (p,v,t) (p,q,v) (t,p,v) (v,p,q) */
        int r = (k == 0 || k == 5) ? v : k == 1 ? q : k == 4 ? t : p;
        int g = (k == 1 || k == 2) ? v : k == 0 ? t : k == 3 ? q : p;
        int b = (k == 3 || k == 4) ? v : k == 2 ? t : k == 5 ? q : p;
        o0[i] = (uint8_t)(s == 0 ? v : r);
        o1[i] = (uint8_t)(s == 0 ? v : g);
        o2[i] = (uint8_t)(s == 0 ? v : b);
    }
}

/* the hue rotation over n pixels, a chunk at a time (the outputs may be the inputs) */
static void rotate_hue(uint8_t *o0, uint8_t *o1, uint8_t *o2, const uint8_t *s0, const uint8_t *s1,
                       const uint8_t *s2, Py_ssize_t n, int shift) {
    uint8_t hsv[3][CHUNK], rgb[3][CHUNK];
    for (Py_ssize_t i0 = 0; i0 < n; i0 += CHUNK) {
        int m = n - i0 < CHUNK ? (int)(n - i0) : CHUNK;
        to_hsv(hsv[0], hsv[1], hsv[2], s0 + i0, s1 + i0, s2 + i0, m);
        from_hsv(rgb[0], rgb[1], rgb[2], hsv[0], hsv[1], hsv[2], m, shift);
        memcpy(o0 + i0, rgb[0], (size_t)m);
        memcpy(o1 + i0, rgb[1], (size_t)m);
        memcpy(o2 + i0, rgb[2], (size_t)m);
    }
}

typedef struct {
    int code;
    double value;
} op_t;

/* the ops on C planes of n values: src -> out for the first, then in place */
static void run(const uint8_t *src, uint8_t *out, int C, Py_ssize_t n, const op_t *ops, int n_ops) {
    uint8_t tab[256];
    const uint8_t *in = src;
    int done = 0;
    for (int k = 0; k < n_ops; k++) {
        int code = ops[k].code;
        float alpha = (float)ops[k].value;
        if (code == 0 || code == 1) {
            int a = 0;
            if (code == 1) {
                int64_t sum = C == 3 ? luma_sum(in, in + n, in + 2 * n, n) : plane_sum(in, n);
                a = n > 0 ? (int)((double)sum / (double)n + 0.5) : 0;
            }
            blend_table(tab, a, alpha);
            apply_table(out, in, (Py_ssize_t)C * n, tab);
        } else if (C == 3 && code == 2) {
            saturate(out, out + n, out + 2 * n, in, in + n, in + 2 * n, n, alpha);
        } else if (C == 3 && code == 3) {
            rotate_hue(out, out + n, out + 2 * n, in, in + n, in + 2 * n, n, (int)ops[k].value & 255);
        } else {
            continue;  /* saturation and hue leave mode L as it is */
        }
        in = out;
        done = 1;
    }
    if (!done && out != src)
        memcpy(out, src, (size_t)C * (size_t)n);
}

static PyObject *py_jitter(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj, *ops_obj;
    Py_buffer src, out;
    op_t ops[MAX_OPS];
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:jitter", &src_obj, &out_obj, &ops_obj))
        return NULL;
    PyObject *seq = PySequence_Fast(ops_obj, "ops should be a sequence of (code, value) pairs");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n_ops = PySequence_Fast_GET_SIZE(seq);
    if (n_ops > MAX_OPS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "ops should hold at most %d pairs, but got %zd", MAX_OPS, n_ops);
    }
    for (Py_ssize_t k = 0; k < n_ops; k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, k);
        if (!PyArg_ParseTuple(item, "id:jitter op", &ops[k].code, &ops[k].value)) {
            Py_DECREF(seq);
            return NULL;
        }
        if (ops[k].code < 0 || ops[k].code > 3 || !isfinite(ops[k].value)) {
            Py_DECREF(seq);
            return PyErr_Format(PyExc_ValueError,
                                "each op should be (code 0..3, a finite value), but got code %d", ops[k].code);
        }
    }
    Py_DECREF(seq);
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    const char *why = NULL;
    if (src.ndim != 3 || src.itemsize != 1 || (src.format != NULL && strcmp(src.format, "B") != 0) ||
        (src.shape[0] != 1 && src.shape[0] != 3))
        why = "src should be a C-contiguous uint8 array of shape (C, H, W) with C 1 or 3";
    else if (out.ndim != 3 || out.itemsize != 1 || (out.format != NULL && strcmp(out.format, "B") != 0) ||
             out.shape[0] != src.shape[0] || out.shape[1] != src.shape[1] || out.shape[2] != src.shape[2])
        why = "out should be a C-contiguous uint8 array of src's shape";
    else if (out.buf != src.buf && (char *)out.buf < (char *)src.buf + src.len &&
             (char *)src.buf < (char *)out.buf + out.len)
        why = "out should be src itself or not overlap it";
    if (why != NULL) {
        PyErr_SetString(PyExc_ValueError, why);
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        return NULL;
    }
    int C = (int)src.shape[0];
    Py_ssize_t n = src.shape[1] * src.shape[2];
    Py_BEGIN_ALLOW_THREADS
    run((const uint8_t *)src.buf, (uint8_t *)out.buf, C, n, ops, (int)n_ops);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}


/* ---- the other operations of the auto-augment policies (pil_op, transform) ---- */

/* PIL's ImageOps tables of one value: posterize's mask (bits 1..8), solarize's
 * threshold, invert, timm's solarize-add (add 0..255) */
static void value_table(uint8_t *tab, int code, double value) {
    for (int i = 0; i < 256; i++) {
        int v = i;
        if (code == 5) {
            int bits = (int)value;
            v = bits < 8 ? i & (~((1 << (8 - bits)) - 1) & 255) : i;
        } else if (code == 6) {
            v = (double)i < value ? i : 255 - i;
        } else if (code == 9) {
            v = 255 - i;
        } else if (code == 12) {
            int s = i + (int)value;
            v = i < 128 ? (s > 255 ? 255 : s) : i;
        }
        tab[i] = (uint8_t)v;
    }
}

TARGETS static void histogram(const uint8_t *p, Py_ssize_t n, int64_t *hist) {
    memset(hist, 0, 256 * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++)
        hist[p[i]]++;
}

/* ImageOps.autocontrast (no cutoff) of one plane: its lowest and highest
 * values stretched to 0..255, int(v * scale + offset) in double, clipped */
static void autocontrast_table(uint8_t *tab, const int64_t *hist) {
    int lo = 0, hi = 255;
    while (lo < 256 && hist[lo] == 0)
        lo++;
    while (hi >= 0 && hist[hi] == 0)
        hi--;
    if (hi <= lo) {
        for (int i = 0; i < 256; i++)
            tab[i] = (uint8_t)i;
        return;
    }
    double scale = 255.0 / (double)(hi - lo);
    double offset = (double)(-lo) * scale;
    for (int i = 0; i < 256; i++) {
        double v = (double)i * scale;
        v = v + offset;
        int iv = v <= -1.0 ? -1 : (int)v;   /* int() truncates toward zero; below zero clips to 0 either way */
        tab[i] = (uint8_t)clip8(iv);
    }
}

/* ImageOps.equalize of one plane: (step // 2 + the count below v) // step,
 * step = (all but the highest value's count) // 255; none when step is 0 */
static void equalize_table(uint8_t *tab, const int64_t *hist, Py_ssize_t n) {
    int top = 255;
    while (top > 0 && hist[top] == 0)
        top--;
    int64_t step = ((int64_t)n - hist[top]) / 255;
    int64_t before = 0;
    for (int i = 0; i < 256; i++) {
        int64_t v = step > 0 ? (step / 2 + before) / step : i;
        tab[i] = (uint8_t)(v > 255 ? 255 : v);
        before += hist[i];
    }
}

/* ImageEnhance.Sharpness of one plane: PIL's 3x3 SMOOTH filter in single
 * precision (from 0.5, the row below first, each row's products left to
 * right), clipped and truncated, the border copied; then the blend of the
 * image with it at alpha.  out apart from src. */
/* one row of the SMOOTH filter (columns 1..m), the rows as floats */
TARGETS static void smooth_row(uint8_t *restrict d, const float *restrict below, const float *restrict mid,
                               const float *restrict above, Py_ssize_t m) {
    const float k1 = 1.0f / 13.0f, k5 = 5.0f / 13.0f;
    for (Py_ssize_t x = 1; x <= m; x++) {
        float ss = 0.5f, r;
        r = below[x - 1] * k1;
        r = r + below[x] * k1;
        r = r + below[x + 1] * k1;
        ss = ss + r;
        r = mid[x - 1] * k1;
        r = r + mid[x] * k5;
        r = r + mid[x + 1] * k1;
        ss = ss + r;
        r = above[x - 1] * k1;
        r = r + above[x] * k1;
        r = r + above[x + 1] * k1;
        ss = ss + r;
        ss = ss < 0.0f ? 0.0f : ss;
        ss = ss > 255.0f ? 255.0f : ss;
        d[x] = (uint8_t)(int)ss;
    }
}

TARGETS static void to_float(float *restrict d, const uint8_t *restrict s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        d[i] = (float)s[i];
}

/* blend(a[i], b[i], alpha) */
TARGETS static void blend_rows(uint8_t *restrict o, const uint8_t *restrict a, const uint8_t *restrict b, Py_ssize_t n,
                               float alpha) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float t = (float)a[i] + alpha * (float)(b[i] - a[i]);
        t = t < 0.0f ? 0.0f : t;
        t = t > 255.0f ? 255.0f : t;
        o[i] = (uint8_t)(int)t;
    }
}

static int sharpen_plane(uint8_t *out, const uint8_t *src, Py_ssize_t h, Py_ssize_t w, float alpha) {
    if (h < 3 || w < 3) {             /* PIL copies an image smaller than the kernel: blend(v, v) is v */
        memcpy(out, src, (size_t)(h * w));
        return 0;
    }
    float *rows = malloc(sizeof(float) * (size_t)(3 * w));
    uint8_t *deg = malloc((size_t)w);
    if (rows == NULL || deg == NULL) {
        free(rows);
        free(deg);
        return -1;
    }
    memcpy(out, src, (size_t)w);
    memcpy(out + (h - 1) * w, src + (h - 1) * w, (size_t)w);
    to_float(rows, src, w);
    to_float(rows + w, src + w, w);
    for (Py_ssize_t y = 1; y < h - 1; y++) {
        float *above = rows + ((y - 1) % 3) * w, *mid = rows + (y % 3) * w, *below = rows + ((y + 1) % 3) * w;
        to_float(below, src + (y + 1) * w, w);
        const uint8_t *s = src + y * w;
        deg[0] = s[0];
        deg[w - 1] = s[w - 1];
        smooth_row(deg, below, mid, above, w - 2);
        blend_rows(out + y * w, deg, s, w, alpha);
    }
    free(rows);
    free(deg);
    return 0;
}

/* one operation of code 4..9 or 12 on C planes of h x w values, src -> out (apart) */
static int run_pil_op(const uint8_t *src, uint8_t *out, int C, Py_ssize_t h, Py_ssize_t w, int code,
                      double value) {
    Py_ssize_t n = h * w;
    uint8_t tab[256];
    int64_t hist[256];
    for (int c = 0; c < C; c++) {
        const uint8_t *s = src + c * n;
        uint8_t *o = out + c * n;
        if (code == 4) {
            if (sharpen_plane(o, s, h, w, (float)value) < 0)
                return -1;
            continue;
        }
        if (code == 7 || code == 8) {
            histogram(s, n, hist);
            if (code == 7)
                autocontrast_table(tab, hist);
            else
                equalize_table(tab, hist, n);
        } else {
            value_table(tab, code, value);
        }
        table_apart(o, s, n, tab);
    }
    return 0;
}

/* PIL's COORD: -1 below zero (and for what is not a number, or past int range: outside either way) */
static inline Py_ssize_t coord(double v) { return v >= 0.0 && v < 2147483648.0 ? (Py_ssize_t)v : -1; }

static inline int fits(const double *a, double x, double y) {
    return fabs(x * a[0] + y * a[1] + a[2]) < 32768.0 && fabs(x * a[3] + y * a[4] + a[5]) < 32768.0;
}

static inline int64_t fix16(double v) { return (int64_t)floor(v * 65536.0 + 0.5); }

/* the nearest-neighbour affine map's source index of each pixel of output row y (-1 outside), PIL's
 * three ways: a scale by tables accumulated in double (cols, rows: made once, way 0); 16.16 fixed
 * point where the corners fit (way 1); else the row accumulated in double (way 2) */
static int nearest_way(const double *a, Py_ssize_t h, Py_ssize_t w, int64_t *fixed, Py_ssize_t *cols,
                       Py_ssize_t *rows) {
    if (a[1] == 0.0 && a[3] == 0.0) {
        double xo = a[2] + a[0] * 0.5;
        for (Py_ssize_t x = 0; x < w; x++) {
            cols[x] = coord(xo);
            xo += a[0];
        }
        double yo = a[5] + a[4] * 0.5;
        for (Py_ssize_t y = 0; y < h; y++) {
            rows[y] = coord(yo);
            yo += a[4];
        }
        return 0;
    }
    double W = (double)w, H = (double)h;
    if (fits(a, 0, 0) && fits(a, W, H) && fits(a, 0, H) && fits(a, W, 0)) {
        double t2 = a[2] + a[0] * 0.5;
        double t5 = a[5] + a[3] * 0.5;
        fixed[0] = fix16(a[0]);
        fixed[1] = fix16(a[1]);
        fixed[2] = fix16(t2 + a[1] * 0.5);
        fixed[3] = fix16(a[3]);
        fixed[4] = fix16(a[4]);
        fixed[5] = fix16(t5 + a[4] * 0.5);
        return 1;
    }
    return 2;
}

/* (way 2: *xo, *yo the row's start, accumulated over the rows before it as PIL does, then moved on) */
TARGETS static void nearest_row(int32_t *idx, int way, const double *a, const int64_t *f, const Py_ssize_t *cols,
                                const Py_ssize_t *rows, Py_ssize_t y, Py_ssize_t h, Py_ssize_t w, double *xo,
                                double *yo) {
    if (way == 0) {
        Py_ssize_t cy = rows[y];
        for (Py_ssize_t x = 0; x < w; x++) {
            Py_ssize_t cx = cols[x];
            idx[x] = cx >= 0 && cx < w && cy >= 0 && cy < h ? (int32_t)(cy * w + cx) : -1;
        }
    } else if (way == 1) {
        int64_t bx = y * f[1] + f[2], by = y * f[4] + f[5];
        for (Py_ssize_t x = 0; x < w; x++) {   /* (integers: the same sums in any order) */
            int64_t xs = (bx + x * f[0]) >> 16, ys = (by + x * f[3]) >> 16;
            int inside = (uint64_t)xs < (uint64_t)w && (uint64_t)ys < (uint64_t)h;
            idx[x] = inside ? (int32_t)(ys * w + xs) : -1;
        }
    } else {
        double xx = *xo, yy = *yo;
        for (Py_ssize_t x = 0; x < w; x++) {
            Py_ssize_t xs = coord(xx), ys = coord(yy);
            idx[x] = xs >= 0 && xs < w && ys >= 0 && ys < h ? (int32_t)(ys * w + xs) : -1;
            xx += a[0];
            yy += a[3];
        }
        *xo += a[1];
        *yo += a[4];
    }
}

TARGETS static int nearest_affine(const uint8_t *src, uint8_t *out, int C, Py_ssize_t h, Py_ssize_t w, const double *a,
                          const uint8_t *fill) {
    Py_ssize_t n = h * w;
    int64_t f[6];
    Py_ssize_t *tabs = malloc(sizeof(Py_ssize_t) * (size_t)(h + w));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)w);
    if (tabs == NULL || idx == NULL) {
        free(tabs);
        free(idx);
        return -1;
    }
    int way = nearest_way(a, h, w, f, tabs, tabs + w);
    double xo = a[2] + a[1] * 0.5, yo = a[5] + a[4] * 0.5;
    xo = xo + a[0] * 0.5;
    yo = yo + a[3] * 0.5;
    for (Py_ssize_t y = 0; y < h; y++) {
        nearest_row(idx, way, a, f, tabs, tabs + w, y, h, w, &xo, &yo);
        if (C == 3) {        /* each pixel's index once for its three planes */
            uint8_t *o0 = out + y * w, *o1 = o0 + n, *o2 = o1 + n;
            const uint8_t *p0 = src, *p1 = src + n, *p2 = src + 2 * n;
            for (Py_ssize_t x = 0; x < w; x++) {
                int32_t k = idx[x];
                if (k >= 0) {
                    o0[x] = p0[k];
                    o1[x] = p1[k];
                    o2[x] = p2[k];
                } else {
                    o0[x] = fill[0];
                    o1[x] = fill[1];
                    o2[x] = fill[2];
                }
            }
            continue;
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *p = src + c * n;
            uint8_t *o = out + c * n + y * w;
            for (Py_ssize_t x = 0; x < w; x++)
                o[x] = idx[x] >= 0 ? p[idx[x]] : fill[c];
        }
    }
    free(tabs);
    free(idx);
    return 0;
}

/* a point's source through the map (a[0..5], or a[0..7] for a perspective one), as PIL's generic
 * transform computes it from the pixel's centre */
static inline void source_point(const double *a, int persp, double X, double Y, double *xin, double *yin) {
    double u = a[0] * X, v = a[3] * X;
    u = u + a[1] * Y;
    v = v + a[4] * Y;
    u = u + a[2];
    v = v + a[5];
    if (persp) {
        double d = a[6] * X;
        d = d + a[7] * Y;
        d = d + 1.0;
        u = u / d;
        v = v / d;
    }
    *xin = u;
    *yin = v;
}

static inline double cubic(double v1, double v2, double v3, double v4, double d) {
    double p1 = v2;
    double p2 = -v1 + v3;
    double p3 = 2 * (v1 - v2) + v3 - v4;
    double p4 = -v1 + v2 - v3 + v4;
    return p1 + d * (p2 + d * (p3 + d * p4));
}

static inline Py_ssize_t clampi(Py_ssize_t v, Py_ssize_t hi) { return v < 0 ? 0 : v > hi ? hi : v; }

/* PIL's generic transform with its bilinear (2) or bicubic (3) filter, or nearest (0) of a
 * perspective map, on C planes; fill[c] outside */
/* where one output row's pixels come from, for PIL's generic transform: each pixel's source point
 * (double precision), then for its filter the source offsets into a plane (rows outside repeat the
 * last row inside, columns are clipped) and the fractions; in[x] 0 where the fill goes */
TARGETS static void row_sources(const double *a, int persp, int filter, Py_ssize_t y, Py_ssize_t h, Py_ssize_t w,
                                int32_t *off, double *fx, double *fy, uint8_t *in) {
    double Y = (double)y + 0.5;
    for (Py_ssize_t x = 0; x < w; x++) {
        double xin, yin;
        source_point(a, persp, (double)x + 0.5, Y, &xin, &yin);
        if (filter == 0) {
            Py_ssize_t xs = coord(xin), ys = coord(yin);
            in[x] = xs >= 0 && xs < w && ys >= 0 && ys < h;
            off[x] = in[x] ? (int32_t)(ys * w + xs) : 0;
            continue;
        }
        in[x] = xin >= 0 && xin < (double)w && yin >= 0 && yin < (double)h;
        if (!in[x]) {
            fx[x] = fy[x] = 0.0;
            for (int j = 0; j < 8; j++)
                off[8 * x + j] = 0;
            continue;
        }
        xin = xin - 0.5;
        yin = yin - 0.5;
        double x0 = floor(xin), y0 = floor(yin);
        fx[x] = xin - x0;
        fy[x] = yin - y0;
        Py_ssize_t xi = (Py_ssize_t)x0, yi = (Py_ssize_t)y0;
        int32_t *o = off + 8 * x;
        if (filter == 2) {   /* columns xi, xi + 1; rows yi and yi + 1 (or yi again) */
            Py_ssize_t r0 = clampi(yi, h - 1), r1 = yi + 1 < h ? yi + 1 : r0;
            o[0] = (int32_t)clampi(xi, w - 1);
            o[1] = (int32_t)clampi(xi + 1, w - 1);
            o[2] = (int32_t)(r0 * w);
            o[3] = (int32_t)(r1 * w);
        } else {             /* columns xi - 1 .. xi + 2; rows yi - 1 .. yi + 2, each outside the one before */
            Py_ssize_t r = clampi(yi - 1, h - 1);
            for (int j = 0; j < 4; j++) {
                Py_ssize_t yy = yi - 1 + j;
                if (j > 0 && yy >= 0 && yy < h)
                    r = yy;
                o[j] = (int32_t)clampi(xi - 1 + j, w - 1);
                o[4 + j] = (int32_t)(r * w);
            }
        }
    }
}

/* PIL's generic transform with its bilinear (2) or bicubic (3) filter, or nearest (0) of a
 * perspective map, on C planes; fill[c] outside */
/* pixels a block of the filters' arithmetic takes at once: their neighbours gathered first, then the
 * same double-precision operations for each pixel of the block (which vectorize: the results are
 * those of one pixel at a time, nothing fused) */
#define BLK 8

/* the bicubic filter of a block of m pixels of one plane */
TARGETS static void bicubic_block(uint8_t *restrict o, const uint8_t *restrict p, const int32_t *restrict k,
                                  const double *restrict fx, const double *restrict fy, int m) {
    double v[16][BLK], r[4][BLK], t[BLK];
    if (m < BLK)                  /* (the lanes past the row's end computed on zeros, and dropped) */
        memset(v, 0, sizeof(v));
    for (int j = 0; j < m; j++) {
        const int32_t *q = k + 8 * j;
        for (int y = 0; y < 4; y++)
            for (int x = 0; x < 4; x++)
                v[4 * y + x][j] = p[q[4 + y] + q[x]];
    }
    for (int y = 0; y < 4; y++)
        for (int j = 0; j < BLK; j++)
            r[y][j] = cubic(v[4 * y][j], v[4 * y + 1][j], v[4 * y + 2][j], v[4 * y + 3][j], fx[j]);
    for (int j = 0; j < BLK; j++) {
        double c = cubic(r[0][j], r[1][j], r[2][j], r[3][j], fy[j]);
        c = c < 0.0 ? 0.0 : c;
        t[j] = c > 255.0 ? 255.0 : c;
    }
    for (int j = 0; j < m; j++)
        o[j] = (uint8_t)(int)t[j];
}

TARGETS static int filtered(const uint8_t *src, uint8_t *out, int C, Py_ssize_t h, Py_ssize_t w, const double *a, int persp,
                    int filter, const uint8_t *fill) {
    Py_ssize_t n = h * w;
    int32_t *off = malloc(sizeof(int32_t) * 8 * (size_t)(w + BLK));
    double *fx = calloc((size_t)(w + BLK), sizeof(double)), *fy = calloc((size_t)(w + BLK), sizeof(double));
    uint8_t *in = malloc((size_t)w);
    if (off == NULL || fx == NULL || fy == NULL || in == NULL) {
        free(off); free(fx); free(fy); free(in);
        return -1;
    }
    for (Py_ssize_t y = 0; y < h; y++) {
        row_sources(a, persp, filter, y, h, w, off, fx, fy, in);
        if (filter == 2) {   /* each pixel's neighbours once for its planes */
            for (Py_ssize_t x = 0; x < w; x++) {
                const int32_t *k = off + 8 * x;
                double dx = fx[x], dy = fy[x];
                for (int c = 0; c < C; c++) {
                    const uint8_t *p = src + c * n;
                    const uint8_t *r0 = p + k[2], *r1 = p + k[3];
                    double p0 = r0[k[0]], q0 = r0[k[1]], p1 = r1[k[0]], q1 = r1[k[1]];
                    double v1 = p0 + (q0 - p0) * dx;
                    double v2 = p1 + (q1 - p1) * dx;
                    out[c * n + y * w + x] = in[x] ? (uint8_t)(int)(v1 + (v2 - v1) * dy) : fill[c];
                }
            }
            continue;
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *p = src + c * n;
            uint8_t *o = out + c * n + y * w;
            if (filter == 0) {
                for (Py_ssize_t x = 0; x < w; x++)
                    o[x] = in[x] ? p[off[x]] : fill[c];
                continue;
            }
            for (Py_ssize_t x = 0; x < w; x += BLK) {
                int m = w - x < BLK ? (int)(w - x) : BLK;
                bicubic_block(o + x, p, off + 8 * x, fx + x, fy + x, m);
            }
            for (Py_ssize_t x = 0; x < w; x++)   /* outside: the fill (row_sources gave offsets 0 there) */
                if (!in[x])
                    o[x] = fill[c];
        }
    }
    free(off); free(fx); free(fy); free(in);
    return 0;
}

static int get_planes(PyObject *src_obj, PyObject *out_obj, Py_buffer *src, Py_buffer *out) {
    if (PyObject_GetBuffer(src_obj, src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (PyObject_GetBuffer(out_obj, out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(src);
        return -1;
    }
    const char *why = NULL;
    if (src->ndim != 3 || src->itemsize != 1 || (src->format != NULL && strcmp(src->format, "B") != 0) ||
        (src->shape[0] != 1 && src->shape[0] != 3))
        why = "src should be a C-contiguous uint8 array of shape (C, H, W) with C 1 or 3";
    else if (out->ndim != 3 || out->itemsize != 1 || (out->format != NULL && strcmp(out->format, "B") != 0) ||
             out->shape[0] != src->shape[0] || out->shape[1] != src->shape[1] || out->shape[2] != src->shape[2])
        why = "out should be a C-contiguous uint8 array of src's shape";
    else if ((char *)out->buf < (char *)src->buf + src->len && (char *)src->buf < (char *)out->buf + out->len)
        why = "out should not overlap src";
    else if (src->shape[1] * src->shape[2] >= ((Py_ssize_t)1 << 31))
        why = "src should have fewer than 2**31 pixels a plane";
    if (why != NULL) {
        PyErr_SetString(PyExc_ValueError, why);
        PyBuffer_Release(src);
        PyBuffer_Release(out);
        return -1;
    }
    return 0;
}

/* the buffers given back; None, or MemoryError where a kernel could not have its scratch memory */
static PyObject *finish(Py_buffer *src, Py_buffer *out, int err) {
    PyBuffer_Release(src);
    PyBuffer_Release(out);
    if (err)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_pil_op(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj;
    int code;
    double value;
    Py_buffer src, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOid:pil_op", &src_obj, &out_obj, &code, &value))
        return NULL;
    int ok = (code >= 4 && code <= 9) || code == 12;
    if (ok && code == 5)
        ok = value >= 1.0 && value <= 8.0;
    if (ok && code == 12)
        ok = value >= 0.0 && value <= 255.0;
    if (!ok || isnan(value))
        return PyErr_Format(PyExc_ValueError, "pil_op takes codes 4..9 and 12 with their values, not (%d, %g)",
                            code, value);
    if (get_planes(src_obj, out_obj, &src, &out) < 0)
        return NULL;
    int C = (int)src.shape[0], err;
    Py_BEGIN_ALLOW_THREADS
    err = run_pil_op((const uint8_t *)src.buf, (uint8_t *)out.buf, C, src.shape[1], src.shape[2], code, value);
    Py_END_ALLOW_THREADS
    return finish(&src, &out, err);
}

static PyObject *py_transform(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj, *coeffs, *fill_obj;
    int filter;
    Py_buffer src, out;
    double a[8];
    uint8_t fill[3] = {0, 0, 0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOiO:transform", &src_obj, &out_obj, &coeffs, &filter, &fill_obj))
        return NULL;
    PyObject *seq = PySequence_Fast(coeffs, "coeffs should be a sequence of 6 or 8 numbers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (m != 6 && m != 8) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "coeffs should hold 6 (affine) or 8 (perspective) numbers, not %zd", m);
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        a[k] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, k));
        if (a[k] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    if (filter != 0 && filter != 2 && filter != 3)
        return PyErr_Format(PyExc_ValueError, "filter should be 0 (nearest), 2 (bilinear) or 3 (bicubic), not %d",
                            filter);
    if (get_planes(src_obj, out_obj, &src, &out) < 0)
        return NULL;
    int C = (int)src.shape[0];
    if (fill_obj != Py_None) {
        PyObject *fs = PySequence_Fast(fill_obj, "fill should be None or one value per plane");
        if (fs == NULL || PySequence_Fast_GET_SIZE(fs) != C) {
            Py_XDECREF(fs);
            PyBuffer_Release(&src);
            PyBuffer_Release(&out);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "fill should be None or one value per plane");
            return NULL;
        }
        for (int c = 0; c < C; c++) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fs, c));
            if ((v == -1 && PyErr_Occurred()) || v < 0 || v > 255) {
                Py_DECREF(fs);
                PyBuffer_Release(&src);
                PyBuffer_Release(&out);
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "fill values should be 0..255");
                return NULL;
            }
            fill[c] = (uint8_t)v;
        }
        Py_DECREF(fs);
    }
    Py_ssize_t h = src.shape[1], w = src.shape[2];
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    if (m == 6 && filter == 0)
        err = nearest_affine((const uint8_t *)src.buf, (uint8_t *)out.buf, C, h, w, a, fill);
    else
        err = filtered((const uint8_t *)src.buf, (uint8_t *)out.buf, C, h, w, a, m == 8, filter, fill);
    Py_END_ALLOW_THREADS
    return finish(&src, &out, err);
}

/* a C-contiguous uint8 buffer of P planes of equal size (len a multiple of P, P >= 1), for tables/histograms */
static int get_bytes(PyObject *obj, Py_buffer *buf, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (buf->itemsize != 1 || (buf->format != NULL && strcmp(buf->format, "B") != 0)) {
        PyErr_Format(PyExc_ValueError, "%s should be a C-contiguous uint8 array", name);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

static PyObject *py_tables(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj, *luts_obj;
    Py_buffer src, out, luts;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:tables", &src_obj, &out_obj, &luts_obj))
        return NULL;
    if (get_bytes(src_obj, &src, 0, "src") < 0)
        return NULL;
    if (get_bytes(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (get_bytes(luts_obj, &luts, 0, "luts") < 0) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t P = luts.len / 256;
    const char *why = NULL;
    if (P < 1 || luts.len != P * 256 || src.len % P != 0)
        why = "luts should hold 256 values for each of src's planes (src's size a multiple of their number)";
    else if (out.len != src.len)
        why = "out should be as large as src";
    else if (out.buf != src.buf && (char *)out.buf < (char *)src.buf + src.len &&
             (char *)src.buf < (char *)out.buf + out.len)
        why = "out should be src itself or not overlap it";
    if (why == NULL) {
        Py_ssize_t n = src.len / P;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t p = 0; p < P; p++)
            apply_table((uint8_t *)out.buf + p * n, (const uint8_t *)src.buf + p * n, n,
                        (const uint8_t *)luts.buf + p * 256);
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, why);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    PyBuffer_Release(&luts);
    if (why != NULL)
        return NULL;
    Py_RETURN_NONE;
}

TARGETS static void count_values(const uint8_t *restrict p, Py_ssize_t n, int64_t *restrict hist) {
    for (Py_ssize_t i = 0; i < n; i++)
        hist[p[i]]++;
}

static PyObject *py_histograms(PyObject *self, PyObject *args) {
    PyObject *src_obj, *hist_obj;
    Py_buffer src, hist;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO:histograms", &src_obj, &hist_obj))
        return NULL;
    if (get_bytes(src_obj, &src, 0, "src") < 0)
        return NULL;
    if (PyObject_GetBuffer(hist_obj, &hist, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t P = hist.len / (256 * 8);
    const char *why = NULL;
    if (hist.itemsize != 8 || (hist.format != NULL && strcmp(hist.format, "q") != 0 && strcmp(hist.format, "l") != 0))
        why = "hist should be a C-contiguous int64 array";
    else if (P < 1 || hist.len != P * 256 * 8 || src.len % P != 0)
        why = "hist should hold 256 counts for each of src's planes (src's size a multiple of their number)";
    if (why == NULL) {
        Py_ssize_t n = src.len / P;
        Py_BEGIN_ALLOW_THREADS
        memset(hist.buf, 0, (size_t)hist.len);
        for (Py_ssize_t p = 0; p < P; p++)
            count_values((const uint8_t *)src.buf + p * n, n, (int64_t *)hist.buf + p * 256);
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, why);
    PyBuffer_Release(&src);
    PyBuffer_Release(&hist);
    if (why != NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef color_methods[] = {
    {"jitter", py_jitter, METH_VARARGS,
     "jitter(src, out, ops) -> None\n"
     "\n"
     "PIL's brightness (0, factor), contrast (1, factor), saturation (2, factor)\n"
     "and hue rotation (3, shift) of src, a C-contiguous uint8 (C, H, W) array\n"
     "with C 1 or 3, applied in the order of ops, into out (src's shape; src\n"
     "itself allowed).  ValueError on other shapes, types or ops."},
    {"pil_op", py_pil_op, METH_VARARGS,
     "pil_op(src, out, code, value) -> None\n"
     "\n"
     "PIL's sharpness (4, factor), posterize (5, bits 1..8), solarize (6,\n"
     "threshold), autocontrast (7), equalize (8), invert (9) or timm's\n"
     "solarize-add (12, 0..255) of src, a C-contiguous uint8 (C, H, W) array\n"
     "with C 1 or 3, into out (src's shape, apart from it)."},
    {"transform", py_transform, METH_VARARGS,
     "transform(src, out, coeffs, filter, fill) -> None\n"
     "\n"
     "PIL's Image.transform of src (as pil_op) by the affine map coeffs (six\n"
     "numbers) or the perspective one (eight), with PIL's filter 0 (nearest),\n"
     "2 (bilinear) or 3 (bicubic), fill (None: zeros; else one value per\n"
     "plane) outside, into out."},
    {"tables", py_tables, METH_VARARGS,
     "tables(src, out, luts) -> None\n"
     "\n"
     "out[p][i] = luts[p][src[p][i]] for each of the P planes of src, a\n"
     "C-contiguous uint8 array cut into P equal planes, P the number of\n"
     "256-value tables in luts (uint8); out: src's size, src itself or apart."},
    {"histograms", py_histograms, METH_VARARGS,
     "histograms(src, hist) -> None\n"
     "\n"
     "hist[p][v] = how often v occurs in plane p of src (a C-contiguous uint8\n"
     "array cut into P equal planes, P the rows of hist, int64 (P, 256))."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef color_module = {PyModuleDef_HEAD_INIT, "coordl.decode._color",
                                          "PIL's colour adjustments on uint8 image planes.", -1, color_methods};

PyMODINIT_FUNC PyInit__color(void) { return PyModule_Create(&color_module); }
