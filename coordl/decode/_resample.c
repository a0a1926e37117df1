/* coordl.decode._resample: PIL's separable resampling of 8-bit images, on
 * numpy arrays, without a PIL image in between.
 *
 * resample(src, out, x0, y0, x1, y1, filter, vertical_first) -> None
 *
 * src: a uint8 array (H, W, C) with C in 1..4, pixels of C bytes side by
 * side in a row (strides (any, C, 1): a slice of a C-contiguous HWC image);
 * out: a writable C-contiguous uint8 buffer of out_h * out_w * C bytes, its
 * shape (out_h, out_w, C).  (x0, y0, x1, y1): the area of src to resample,
 * in pixels, fractions allowed (PIL's `box`).  filter: 0 bilinear (triangle,
 * support 1), 1 bicubic (Keys, a = -0.5, support 2).  vertical_first: which
 * of the two passes runs first.
 *
 * The arithmetic is PIL's (Image.resize, mode RGB/L, a box): per output
 * pixel a window of the filter scaled by the reduction factor (never below
 * 1), its weights normalized to sum 1 in double precision, then rounded to
 * fixed point with 22 fractional bits; each pass accumulates in 32-bit
 * integers from half a unit and clips to 0..255, so the image between the
 * passes is 8-bit.  Given the same pass order, the result is PIL's bit for
 * bit (checked against the installed PIL when first used, see
 * coordl/decode/resample.py).  A pass whose axis keeps its size and whole
 * extent is skipped, as PIL skips it.  The GIL is released while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define FRAC_BITS 22

/* The two passes are compiled for AVX2 as well as the baseline, the right
 * one picked when the module loads (gcc's function multi-versioning). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TARGETS __attribute__((target_clones("avx2", "default")))
#else
#define TARGETS
#endif

typedef double (*kernel_fn)(double);

static double triangle(double x) {
    x = fabs(x);
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Keys' cubic convolution kernel with a = -0.5 */
static double keys_cubic(double x) {
    const double a = -0.5;
    x = fabs(x);
    if (x < 1.0)
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0)
        return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

typedef struct {
    int taps;      /* weights per output pixel (the widest window) */
    int *start;    /* first input pixel of each output pixel's window */
    int *count;    /* pixels in that window */
    int32_t *w;    /* fixed-point weights, taps per output pixel */
} weights;

static void weights_free(weights *wt) {
    PyMem_RawFree(wt->start);
    PyMem_RawFree(wt->count);
    PyMem_RawFree(wt->w);
    wt->start = wt->count = NULL;
    wt->w = NULL;
}

/* The window and weights of each of `n_out` output pixels over the input
 * extent [lo, hi) of an axis of `n_in` pixels.  0, or -1 when out of memory. */
static int weights_make(weights *wt, int n_in, float lo, float hi, int n_out, kernel_fn f,
                        double support) {
    double scale = (double)(hi - lo) / n_out;
    double stretch = scale < 1.0 ? 1.0 : scale;
    double reach = support * stretch;
    double inv = 1.0 / stretch;
    int taps = (int)ceil(reach) * 2 + 1;
    double *tmp = PyMem_RawMalloc(sizeof(double) * (size_t)taps);
    wt->taps = taps;
    wt->start = PyMem_RawMalloc(sizeof(int) * (size_t)n_out);
    wt->count = PyMem_RawMalloc(sizeof(int) * (size_t)n_out);
    wt->w = PyMem_RawCalloc((size_t)n_out * (size_t)taps, sizeof(int32_t));
    if (tmp == NULL || wt->start == NULL || wt->count == NULL || wt->w == NULL) {
        PyMem_RawFree(tmp);
        weights_free(wt);
        return -1;
    }
    for (int o = 0; o < n_out; o++) {
        double center = lo + (o + 0.5) * scale;
        int first = (int)(center - reach + 0.5);
        int end = (int)(center + reach + 0.5);
        if (first < 0)
            first = 0;
        if (end > n_in)
            end = n_in;
        int n = end - first;
        double sum = 0.0;
        for (int i = 0; i < n; i++) {
            tmp[i] = f((i + first - center + 0.5) * inv);
            sum += tmp[i];
        }
        int32_t *w = wt->w + (size_t)o * taps;
        for (int i = 0; i < n; i++) {
            double v = sum != 0.0 ? tmp[i] / sum : tmp[i];
            double fx = v * (1 << FRAC_BITS);
            w[i] = (int32_t)(v < 0 ? fx - 0.5 : fx + 0.5);
        }
        wt->start[o] = first;
        wt->count[o] = n > 0 ? n : 0;
    }
    PyMem_RawFree(tmp);
    return 0;
}

static inline uint8_t to_u8(int32_t acc) {
    int32_t v = acc >> FRAC_BITS;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* Rows of the horizontal pass handled together: STRIP rows are interleaved
 * pixel by pixel into a scratch block (pixel x of every row side by side),
 * so that each output pixel is a weighted sum of contiguous runs of
 * STRIP * C bytes, which the compiler vectorizes as it does the vertical
 * pass.  (Computed in that order, each value is the same integer sum.) */
#define STRIP 16

static inline void rows_strips(uint8_t *restrict dst, const uint8_t *restrict src, Py_ssize_t sstride,
                               int row0, int rows, const int C, const weights *wt, int n_out,
                               uint8_t *restrict strip, uint8_t *restrict outs) {
    const int32_t half = 1 << (FRAC_BITS - 1);
    const int L = STRIP * C;  /* lanes: the interleaved bytes of one input pixel */
    const int P = L + 4;      /* their pitch: room for a 4-byte copy of the last row's pixel */
    int32_t acc[STRIP * 4];
    int c0 = wt->start[0], c1 = wt->start[n_out - 1] + wt->count[n_out - 1];
    for (int s = 0; s < rows; s += STRIP) {
        int R = rows - s < STRIP ? rows - s : STRIP;
        for (int r = 0; r < R; r++) {
            const uint8_t *line = src + (Py_ssize_t)(row0 + s + r) * sstride;
            uint8_t *t = strip + r * C;
            int x = c0;
            if (C == 3)  /* 4 bytes at a time (the 4th lands in the next row's lane or the pad), but the row's last pixel */
                for (; x < c1 - 1; x++)
                    memcpy(t + (size_t)x * P, line + (size_t)x * 3, 4);
            for (; x < c1; x++)
                for (int c = 0; c < C; c++)
                    t[(size_t)x * P + c] = line[(size_t)x * C + c];
        }
        for (int x = 0; x < n_out; x++) {
            const int32_t *w = wt->w + (size_t)x * wt->taps;
            const uint8_t *p = strip + (size_t)wt->start[x] * P;
            int n = wt->count[x];
            for (int j = 0; j < L; j++)
                acc[j] = half;
            for (int i = 0; i < n; i++) {
                const uint8_t *q = p + (size_t)i * P;
                int32_t k = w[i];
                for (int j = 0; j < L; j++)
                    acc[j] += q[j] * k;
            }
            uint8_t *ob = outs + (size_t)x * P;  /* the strip's outputs, interleaved as its inputs */
            for (int j = 0; j < L; j++) {
                int32_t v = acc[j] >> FRAC_BITS;
                ob[j] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
        }
        for (int r = 0; r < R; r++) {  /* back to rows */
            uint8_t *o = dst + (size_t)(s + r) * n_out * C;
            const uint8_t *b = outs + r * C;
            int x = 0;
            if (C == 3)  /* 4 bytes at a time: the 4th is the next pixel's, written next */
                for (; x < n_out - 1; x++)
                    memcpy(o + (size_t)x * 3, b + (size_t)x * P, 4);
            for (; x < n_out; x++)
                for (int c = 0; c < C; c++)
                    o[(size_t)x * C + c] = b[(size_t)x * P + c];
        }
    }
}

/* Along rows: dst (rows x n_out pixels, contiguous) from src rows
 * [row0, row0 + rows) (row stride `sstride`, pixel stride C); `strip`
 * holds STRIP * C + 4 bytes per input pixel of a row, `outs` as many per
 * output pixel. */
TARGETS static void pass_rows(uint8_t *restrict dst, const uint8_t *restrict src, Py_ssize_t sstride,
                              int row0, int rows, int C, const weights *wt, int n_out,
                              uint8_t *restrict strip, uint8_t *restrict outs) {
    switch (C) {  /* a constant C for each: fixed-length inner loops */
    case 1: rows_strips(dst, src, sstride, row0, rows, 1, wt, n_out, strip, outs); break;
    case 2: rows_strips(dst, src, sstride, row0, rows, 2, wt, n_out, strip, outs); break;
    case 3: rows_strips(dst, src, sstride, row0, rows, 3, wt, n_out, strip, outs); break;
    default: rows_strips(dst, src, sstride, row0, rows, 4, wt, n_out, strip, outs); break;
    }
}

/* Along columns: dst (n_out rows of `len` bytes, contiguous) from src rows
 * (row stride `sstride`, `len` bytes each, starting `col0` bytes in); acc
 * holds `len` int32. */
TARGETS static void pass_cols(uint8_t *restrict dst, const uint8_t *restrict src, Py_ssize_t sstride, Py_ssize_t col0, int len,
                      const weights *wt, int n_out, int32_t *restrict acc) {
    const int32_t half = 1 << (FRAC_BITS - 1);
    for (int y = 0; y < n_out; y++) {
        const int32_t *w = wt->w + (size_t)y * wt->taps;
        int first = wt->start[y], n = wt->count[y];
        for (int j = 0; j < len; j++)
            acc[j] = half;
        for (int i = 0; i < n; i++) {
            const uint8_t *line = src + (Py_ssize_t)(first + i) * sstride + col0;
            int32_t k = w[i];
            for (int j = 0; j < len; j++)
                acc[j] += line[j] * k;
        }
        uint8_t *o = dst + (size_t)y * len;
        for (int j = 0; j < len; j++)
            o[j] = to_u8(acc[j]);
    }
}

typedef struct {
    const uint8_t *src;
    Py_ssize_t sstride;
    int H, W, C;    /* the whole image's size: the weights and their clamping are its */
    int sy, sx;     /* where src's first row and column lie in the whole image */
    int sh, sw;     /* src's rows and columns */
    float box[4];   /* x0, y0, x1, y1 */
    int out_h, out_w;   /* the whole output's size */
    int oy, ox, oh, ow; /* the window of it written to `out` (oh x ow pixels) */
    kernel_fn f;
    double support;
    int vfirst;
    uint8_t *out;
} job_t;

/* Move the weights of outputs [o0, o0 + n) of `all` into `view`, their
 * windows in src's coordinates (`origin` subtracted); 0, or -1 when one
 * reaches outside src's `n_src` pixels. */
static int weights_window(weights *view, const weights *all, int o0, int n, int origin, int n_src) {
    view->taps = all->taps;
    view->start = all->start + o0;
    view->count = all->count + o0;
    view->w = all->w + (size_t)o0 * all->taps;
    for (int o = 0; o < n; o++) {
        view->start[o] -= origin;
        if (view->count[o] > 0 && (view->start[o] < 0 || view->start[o] + view->count[o] > n_src))
            return -1;
        if (view->count[o] <= 0)
            view->start[o] = 0;
    }
    return 0;
}

/* 0; -1 when out of memory; -2 when the window needs pixels outside src */
static int run(job_t *j) {
    weights wx = {0}, wy = {0}, vx, vy;
    uint8_t *tmp = NULL, *strip = NULL, *outs = NULL;
    int32_t *acc = NULL;
    int rc = -1;
    int C = j->C;
    int need_x = j->out_w != j->W || j->box[0] != 0.0f || j->box[2] != (float)j->W;
    int need_y = j->out_h != j->H || j->box[1] != 0.0f || j->box[3] != (float)j->H;
    if (weights_make(&wx, j->W, j->box[0], j->box[2], j->out_w, j->f, j->support) < 0 ||
        weights_make(&wy, j->H, j->box[1], j->box[3], j->out_h, j->f, j->support) < 0)
        goto done;
    rc = -2;
    /* a skipped pass maps output pixel o to input pixel o */
    if ((need_x && weights_window(&vx, &wx, j->ox, j->ow, j->sx, j->sw) < 0) ||
        (need_y && weights_window(&vy, &wy, j->oy, j->oh, j->sy, j->sh) < 0) ||
        (!need_x && (j->ox < j->sx || j->ox + j->ow > j->sx + j->sw)) ||
        (!need_y && (j->oy < j->sy || j->oy + j->oh > j->sy + j->sh)))
        goto done;
    rc = -1;
    int ix = j->ox - j->sx, iy = j->oy - j->sy;  /* src's first pixel of a skipped pass's window */
    if (need_x) {
        strip = PyMem_RawCalloc((size_t)j->sw * (STRIP * C + 4), 1);
        outs = PyMem_RawCalloc((size_t)j->ow * (STRIP * C + 4), 1);
        if (strip == NULL || outs == NULL)
            goto done;
    }
    if (!need_x && !need_y) {
        for (int r = 0; r < j->oh; r++)
            memcpy(j->out + (size_t)r * j->ow * C, j->src + (Py_ssize_t)(iy + r) * j->sstride + (Py_ssize_t)ix * C,
                   (size_t)j->ow * C);
        rc = 0;
        goto done;
    }
    if (need_x && need_y && !j->vfirst) {
        /* rows first, only those the column pass reads */
        int r0 = vy.start[0];
        int r1 = vy.start[j->oh - 1] + vy.count[j->oh - 1];
        if (r1 < r0)
            r1 = r0;
        int len = j->ow * C;
        tmp = PyMem_RawMalloc((size_t)(r1 - r0) * len + 1);
        acc = PyMem_RawMalloc(sizeof(int32_t) * (size_t)len + 1);
        if (tmp == NULL || acc == NULL)
            goto done;
        pass_rows(tmp, j->src, j->sstride, r0, r1 - r0, C, &vx, j->ow, strip, outs);
        for (int y = 0; y < j->oh; y++)
            vy.start[y] -= r0;
        pass_cols(j->out, tmp, len, 0, len, &vy, j->oh, acc);
    } else if (need_x && need_y) {
        /* columns first, over the columns the row pass reads */
        int c0 = vx.start[0];
        int c1 = vx.start[j->ow - 1] + vx.count[j->ow - 1];
        if (c1 < c0)
            c1 = c0;
        int len = (c1 - c0) * C;
        tmp = PyMem_RawMalloc((size_t)j->oh * len + 1);
        acc = PyMem_RawMalloc(sizeof(int32_t) * (size_t)len + 1);
        if (tmp == NULL || acc == NULL)
            goto done;
        pass_cols(tmp, j->src, j->sstride, (Py_ssize_t)c0 * C, len, &vy, j->oh, acc);
        for (int x = 0; x < j->ow; x++)
            vx.start[x] -= c0;
        pass_rows(j->out, tmp, len, 0, j->oh, C, &vx, j->ow, strip, outs);
    } else if (need_x) {
        pass_rows(j->out, j->src, j->sstride, iy, j->oh, C, &vx, j->ow, strip, outs);
    } else {
        int len = j->ow * C;
        acc = PyMem_RawMalloc(sizeof(int32_t) * (size_t)len + 1);
        if (acc == NULL)
            goto done;
        pass_cols(j->out, j->src, j->sstride, (Py_ssize_t)ix * C, len, &vy, j->oh, acc);
    }
    rc = 0;
done:
    weights_free(&wx);
    weights_free(&wy);
    PyMem_RawFree(tmp);
    PyMem_RawFree(strip);
    PyMem_RawFree(outs);
    PyMem_RawFree(acc);
    return rc;
}

/* Checks shared by resample() and resample_window(): NULL, or why not. */
static const char *check_buffers(const Py_buffer *src, const Py_buffer *out, int filter) {
    if (src->ndim != 3 || src->itemsize != 1 || (src->format != NULL && strcmp(src->format, "B") != 0))
        return "src should be a uint8 array of shape (H, W, C)";
    if (src->shape[2] < 1 || src->shape[2] > 4 || src->strides[2] != 1 || src->strides[1] != src->shape[2] ||
        src->strides[0] < src->shape[1] * src->shape[2] || src->shape[0] < 1 || src->shape[1] < 1 ||
        src->shape[0] > INT_MAX / 4 || src->shape[1] > INT_MAX / 4)
        return "src should hold 1 to 4 channels of pixels side by side in each row (strides (any, C, 1))";
    if (out->ndim != 3 || out->itemsize != 1 || out->shape[2] != src->shape[2] || out->shape[0] < 1 ||
        out->shape[1] < 1 || out->shape[0] > INT_MAX / 4 || out->shape[1] > INT_MAX / 4 ||
        out->shape[1] * out->shape[2] > INT_MAX / 4)
        return "out should be a C-contiguous uint8 array (out_h, out_w, C) with src's C";
    if (filter != 0 && filter != 1)
        return "filter should be 0 (bilinear) or 1 (bicubic)";
    return NULL;
}

static PyObject *finish(job_t *j, Py_buffer *src, Py_buffer *out, const char *why) {
    int rc = 0;
    if (why == NULL) {
        Py_BEGIN_ALLOW_THREADS
        rc = run(j);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(src);
    PyBuffer_Release(out);
    if (why != NULL) {
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    if (rc == -2) {
        PyErr_SetString(PyExc_ValueError, "the output window needs pixels outside src");
        return NULL;
    }
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static void job_fill(job_t *j, const Py_buffer *src, Py_buffer *out, double x0, double y0, double x1, double y1,
                     int filter, int vfirst) {
    memset(j, 0, sizeof *j);
    j->src = (const uint8_t *)src->buf;
    j->sstride = src->strides[0];
    j->H = j->sh = (int)src->shape[0];
    j->W = j->sw = (int)src->shape[1];
    j->C = (int)src->shape[2];
    j->box[0] = (float)x0;
    j->box[1] = (float)y0;
    j->box[2] = (float)x1;
    j->box[3] = (float)y1;
    j->out_h = j->oh = (int)out->shape[0];
    j->out_w = j->ow = (int)out->shape[1];
    j->f = filter == 0 ? triangle : keys_cubic;
    j->support = filter == 0 ? 1.0 : 2.0;
    j->vfirst = vfirst;
    j->out = (uint8_t *)out->buf;
}

static int get_buffers(PyObject *src_obj, PyObject *out_obj, Py_buffer *src, Py_buffer *out) {
    if (PyObject_GetBuffer(src_obj, src, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return -1;
    if (PyObject_GetBuffer(out_obj, out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

static PyObject *py_resample(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj;
    double x0, y0, x1, y1;
    int filter, vfirst;
    Py_buffer src, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOddddip:resample", &src_obj, &out_obj, &x0, &y0, &x1, &y1, &filter,
                          &vfirst))
        return NULL;
    if (get_buffers(src_obj, out_obj, &src, &out) < 0)
        return NULL;
    const char *why = check_buffers(&src, &out, filter);
    if (why == NULL && !(x0 >= 0 && y0 >= 0 && x1 > x0 && y1 > y0 && x1 <= (double)src.shape[1] &&
                         y1 <= (double)src.shape[0]))
        why = "the box (x0, y0, x1, y1) should lie inside src, with x1 > x0 and y1 > y0";
    job_t j;
    if (why == NULL)
        job_fill(&j, &src, &out, x0, y0, x1, y1, filter, vfirst);
    return finish(&j, &src, &out, why);
}

static PyObject *py_resample_window(PyObject *self, PyObject *args) {
    PyObject *src_obj, *out_obj;
    double x0, y0, x1, y1;
    int filter, vfirst, full_h, full_w, src_y, src_x, out_h, out_w, win_y, win_x;
    Py_buffer src, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOddddip(ii)(ii)(ii)(ii):resample_window", &src_obj, &out_obj, &x0, &y0, &x1,
                          &y1, &filter, &vfirst, &full_h, &full_w, &src_y, &src_x, &out_h, &out_w, &win_y, &win_x))
        return NULL;
    if (get_buffers(src_obj, out_obj, &src, &out) < 0)
        return NULL;
    const char *why = check_buffers(&src, &out, filter);
    if (why == NULL && !(full_h >= 1 && full_w >= 1 && full_h <= INT_MAX / 4 && full_w <= INT_MAX / 4 &&
                         src_y >= 0 && src_x >= 0 && src_y + src.shape[0] <= full_h &&
                         src_x + src.shape[1] <= full_w))
        why = "src should be a part of the whole image: 0 <= (src_y, src_x) and src inside (full_h, full_w)";
    else if (why == NULL && !(x0 >= 0 && y0 >= 0 && x1 > x0 && y1 > y0 && x1 <= (double)full_w &&
                              y1 <= (double)full_h))
        why = "the box (x0, y0, x1, y1) should lie inside the whole image, with x1 > x0 and y1 > y0";
    else if (why == NULL && !(out_h >= 1 && out_w >= 1 && out_h <= INT_MAX / 4 && out_w <= INT_MAX / 4 &&
                              win_y >= 0 && win_x >= 0 && win_y + out.shape[0] <= out_h &&
                              win_x + out.shape[1] <= out_w))
        why = "out should be a window of the whole output: 0 <= (win_y, win_x) and out inside (out_h, out_w)";
    job_t j;
    if (why == NULL) {
        job_fill(&j, &src, &out, x0, y0, x1, y1, filter, vfirst);
        j.H = full_h;
        j.W = full_w;
        j.sy = src_y;
        j.sx = src_x;
        j.out_h = out_h;
        j.out_w = out_w;
        j.oy = win_y;
        j.ox = win_x;
    }
    return finish(&j, &src, &out, why);
}

static PyObject *py_span(PyObject *self, PyObject *args) {
    int n_in, n_out, filter, o0, o1;
    double lo, hi;
    (void)self;
    if (!PyArg_ParseTuple(args, "iddiiii:span", &n_in, &lo, &hi, &n_out, &filter, &o0, &o1))
        return NULL;
    if (!(n_in >= 1 && n_out >= 1 && n_in <= INT_MAX / 4 && n_out <= INT_MAX / 4 && lo >= 0 && hi > lo &&
          hi <= (double)n_in && 0 <= o0 && o0 < o1 && o1 <= n_out && (filter == 0 || filter == 1))) {
        PyErr_SetString(PyExc_ValueError, "span: 0 <= lo < hi <= n_in, 0 <= o0 < o1 <= n_out, filter 0 or 1");
        return NULL;
    }
    weights wt = {0};
    if (weights_make(&wt, n_in, (float)lo, (float)hi, n_out, filter == 0 ? triangle : keys_cubic,
                     filter == 0 ? 1.0 : 2.0) < 0)
        return PyErr_NoMemory();
    int first = n_in, end = 0;
    for (int o = o0; o < o1; o++) {
        if (wt.count[o] <= 0)
            continue;
        if (wt.start[o] < first)
            first = wt.start[o];
        if (wt.start[o] + wt.count[o] > end)
            end = wt.start[o] + wt.count[o];
    }
    weights_free(&wt);
    if (end < first)
        first = end = 0;
    return Py_BuildValue("(ii)", first, end);
}

static PyMethodDef resample_methods[] = {
    {"resample", py_resample, METH_VARARGS,
     "resample(src, out, x0, y0, x1, y1, filter, vertical_first) -> None\n"
     "\n"
     "PIL's resampling (filter 0 bilinear, 1 bicubic) of the box (x0, y0, x1, y1)\n"
     "of src, a uint8 (H, W, C) array with strides (any, C, 1), into out, a\n"
     "C-contiguous uint8 (out_h, out_w, C) array, the vertical pass first when\n"
     "vertical_first.  ValueError on other shapes, types or boxes."},
    {"resample_window", py_resample_window, METH_VARARGS,
     "resample_window(src, out, x0, y0, x1, y1, filter, vertical_first, (full_h, full_w), (src_y, src_x),\n"
     "                (out_h, out_w), (win_y, win_x)) -> None\n"
     "\n"
     "A window of resample(): the whole image is (full_h, full_w), of which src\n"
     "holds the part from (src_y, src_x); its box (x0, y0, x1, y1), in the whole\n"
     "image's pixels, resampled to (out_h, out_w), of which out receives the\n"
     "window from (win_y, win_x), the pixels the whole resample gives there.\n"
     "ValueError when the window needs pixels src does not hold (see span())."},
    {"span", py_span, METH_VARARGS,
     "span(n_in, lo, hi, n_out, filter, o0, o1) -> (first, end)\n"
     "\n"
     "The input pixels [first, end) that outputs [o0, o1) of resampling\n"
     "[lo, hi) of an axis of n_in pixels to n_out read."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef resample_module = {PyModuleDef_HEAD_INIT, "coordl.decode._resample",
                                             "PIL's 8-bit resampling on numpy arrays.", -1,
                                             resample_methods};

PyMODINIT_FUNC PyInit__resample(void) { return PyModule_Create(&resample_module); }
