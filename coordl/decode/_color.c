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
 * coordl/decode/color.py checks this against the installed PIL when first
 * used (built with -ffp-contract=off: no fused multiply-add where PIL's
 * expressions round twice).  The GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
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

static PyMethodDef color_methods[] = {
    {"jitter", py_jitter, METH_VARARGS,
     "jitter(src, out, ops) -> None\n"
     "\n"
     "PIL's brightness (0, factor), contrast (1, factor), saturation (2, factor)\n"
     "and hue rotation (3, shift) of src, a C-contiguous uint8 (C, H, W) array\n"
     "with C 1 or 3, applied in the order of ops, into out (src's shape; src\n"
     "itself allowed).  ValueError on other shapes, types or ops."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef color_module = {PyModuleDef_HEAD_INIT, "coordl.decode._color",
                                          "PIL's colour adjustments on uint8 image planes.", -1, color_methods};

PyMODINIT_FUNC PyInit__color(void) { return PyModule_Create(&color_module); }
