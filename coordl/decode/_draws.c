/* coordl.decode._draws: RandomResizedCrop's (and a following flip's) draws
 * for a batch of samples, each from its own generator, as coordl._rng.derive
 * and coordl.decode.ops._draw_box make them in Python.
 *
 * derive(seed, epoch, index) is random.Random(key) with key = seed << 128 |
 * epoch << 64 | index: CPython seeds its Mersenne Twister from the key's
 * 32-bit words (init_by_array over the words up to the highest non-zero
 * one).  random() is the 53-bit float of two 32-bit outputs, uniform(a, b)
 * is a + (b - a) * random(), randint(a, b) draws getrandbits(k) (the top k
 * bits of one output, k the bit length of b - a + 1) until it is below that
 * width.  The Python module checks these draws against Python's own, for the
 * interpreter it runs on, before it uses them (coordl.device.encoded).
 *
 * rrc(indices, heights, widths, seed, epoch, s_lo, s_hi, lr_lo, lr_hi,
 *     r_min, r_max, flip_p, out[, seeds]): int64 buffers of n; out an int64
 * buffer of 5 n: (top, left, h, w, flip) per sample; flip_p < 0: no flip
 * step.  seeds (optional, int64 of n or 2 n): the generator's next
 * getrandbits(63) after those draws (its first 32-bit output the low word,
 * the top 31 bits of the second the high word): the seed
 * coordl._rng.global_seeds gives torch's generator for the sample's
 * as-written steps; of 2 n, that and the next, Python's seed, per sample.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MT_N 624
#define MT_M 397

typedef struct {
    uint32_t mt[MT_N];
    int index;      /* the next output's entry */
    int twisted;    /* entries of the current generation made so far (the twist runs entry by entry, as needed) */
} mt_state;

static uint32_t base_state[MT_N];   /* init_genrand(19650218): where every seeding starts */

static void init_genrand(mt_state *s, uint32_t seed) {
    uint32_t *mt = s->mt;
    mt[0] = seed;
    for (int i = 1; i < MT_N; i++)
        mt[i] = 1812433253U * (mt[i - 1] ^ (mt[i - 1] >> 30)) + (uint32_t)i;
    s->index = MT_N;
}

static void init_by_array(mt_state *s, const uint32_t *key, size_t len) {
    uint32_t *mt = s->mt;
    size_t i = 1, j = 0, k;
    memcpy(mt, base_state, sizeof(base_state));
    for (k = MT_N > len ? MT_N : len; k; k--) {
        mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525U)) + key[j] + (uint32_t)j;
        i++;
        j++;
        if (i >= MT_N) {
            mt[0] = mt[MT_N - 1];
            i = 1;
        }
        if (j >= len)
            j = 0;
    }
    for (k = MT_N - 1; k; k--) {
        mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941U)) - (uint32_t)i;
        i++;
        if (i >= MT_N) {
            mt[0] = mt[MT_N - 1];
            i = 1;
        }
    }
    mt[0] = 0x80000000U;
    s->index = MT_N;
}

/* The twist makes entry kk of the next generation from entries kk and kk + 1
 * of the current one and entry kk + M (current below N - M, new above): made
 * in order, one entry at a time as outputs need them, it gives the whole
 * twist's values; a sample draws a few dozen outputs, not 624. */
static uint32_t next32(mt_state *s) {
    static const uint32_t mag01[2] = {0x0U, 0x9908b0dfU};
    uint32_t *mt = s->mt, y;
    if (s->index >= MT_N) {
        s->index = 0;
        s->twisted = 0;
    }
    if (s->index >= s->twisted) {
        int kk = s->twisted++;
        if (kk < MT_N - 1) {
            y = (mt[kk] & 0x80000000U) | (mt[kk + 1] & 0x7fffffffU);
            mt[kk] = mt[kk < MT_N - MT_M ? kk + MT_M : kk + (MT_M - MT_N)] ^ (y >> 1) ^ mag01[y & 0x1U];
        } else {
            y = (mt[MT_N - 1] & 0x80000000U) | (mt[0] & 0x7fffffffU);
            mt[MT_N - 1] = mt[MT_M - 1] ^ (y >> 1) ^ mag01[y & 0x1U];
        }
    }
    y = mt[s->index++];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= (y >> 18);
    return y;
}

static double next_double(mt_state *s) {
    uint32_t a = next32(s) >> 5, b = next32(s) >> 6;
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
}

/* randint(0, hi), hi >= 0 and below 2**32 */
static int64_t randint0(mt_state *s, int64_t hi) {
    uint64_t n = (uint64_t)hi + 1;
    int k = 0;
    while ((n >> k) != 0)
        k++;                        /* n's bit length, 1..33 */
    if (k > 32)
        return -1;                  /* not reached for image sizes; the caller refuses such sizes */
    uint64_t r;
    do {
        r = next32(s) >> (32 - k);
    } while (r >= n);
    return (int64_t)r;
}

static void seed_sample(mt_state *s, uint64_t seed, uint64_t epoch, uint64_t index) {
    uint32_t key[6] = {(uint32_t)index, (uint32_t)(index >> 32), (uint32_t)epoch, (uint32_t)(epoch >> 32),
                       (uint32_t)seed, (uint32_t)(seed >> 32)};
    size_t used = 6;
    while (used > 1 && key[used - 1] == 0)
        used--;
    init_by_array(s, key, used);
}

static PyObject *rrc(PyObject *self, PyObject *args) {
    Py_buffer bi, bh, bw, bo, bs;
    unsigned long long seed, epoch;
    double s_lo, s_hi, lr_lo, lr_hi, r_min, r_max, flip_p;
    bs.obj = NULL;
    bs.buf = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*KKdddddddw*|w*", &bi, &bh, &bw, &seed, &epoch, &s_lo, &s_hi, &lr_lo, &lr_hi,
                          &r_min, &r_max, &flip_p, &bo, &bs))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = bi.len / 8;
    if (bh.len != bi.len || bw.len != bi.len || bo.len != 5 * bi.len || bi.len % 8 ||
        (bs.buf != NULL && bs.len != bi.len && bs.len != 2 * bi.len)) {
        PyErr_SetString(PyExc_ValueError, "rrc: indices, heights and widths of n int64, out of 5 n, seeds of n or 2 n");
        goto done;
    }
    int64_t *seeds = bs.buf;
    const int per = (bs.buf != NULL && bs.len == 2 * bi.len) ? 2 : 1;
    const int64_t *ind = bi.buf, *hs = bh.buf, *ws = bw.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (ind[k] < 0 || hs[k] <= 0 || ws[k] <= 0 || hs[k] > 0xFFFFFFFFLL || ws[k] > 0xFFFFFFFFLL) {
            PyErr_SetString(PyExc_ValueError, "rrc: an index below 0 or a size out of range");
            goto done;
        }
    }
    int64_t *out = bo.buf;
    Py_BEGIN_ALLOW_THREADS
    mt_state st;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t height = hs[k], width = ws[k], top = 0, left = 0, h = 0, w = 0;
        int found = 0;
        seed_sample(&st, seed, epoch, (uint64_t)ind[k]);
        double area = (double)(height * width);
        for (int attempt = 0; attempt < 10 && !found; attempt++) {
            double target = area * (s_lo + (s_hi - s_lo) * next_double(&st));
            double aspect = exp(lr_lo + (lr_hi - lr_lo) * next_double(&st));
            w = (int64_t)nearbyint(sqrt(target * aspect));
            h = (int64_t)nearbyint(sqrt(target / aspect));
            if (0 < w && w <= width && 0 < h && h <= height) {
                top = randint0(&st, height - h);
                left = randint0(&st, width - w);
                found = 1;
            }
        }
        if (!found) {
            double in_ratio = (double)width / (double)height;
            if (in_ratio < r_min) {
                w = width;
                h = (int64_t)nearbyint((double)width / r_min);
            } else if (in_ratio > r_max) {
                w = (int64_t)nearbyint((double)height * r_max);
                h = height;
            } else {
                w = width;
                h = height;
            }
            /* Python's floor division of possibly negative differences */
            int64_t dh = height - h, dw = width - w;
            top = dh >= 0 ? dh / 2 : -((-dh + 1) / 2);
            left = dw >= 0 ? dw / 2 : -((-dw + 1) / 2);
        }
        int64_t flip = flip_p >= 0 ? (next_double(&st) < flip_p) : 0;
        out[5 * k] = top;
        out[5 * k + 1] = left;
        out[5 * k + 2] = h;
        out[5 * k + 3] = w;
        out[5 * k + 4] = flip;
        for (int q = 0; seeds != NULL && q < per; q++) {
            uint64_t lo = next32(&st), hi = next32(&st) >> 1;
            seeds[per * k + q] = (int64_t)(lo | (hi << 32));
        }
    }
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&bi);
    PyBuffer_Release(&bh);
    PyBuffer_Release(&bw);
    PyBuffer_Release(&bo);
    if (bs.obj != NULL)
        PyBuffer_Release(&bs);
    return ret;
}

/* words(seed, epoch, index, count): the generator's first count 32-bit
 * outputs (getrandbits(32) each), as bytes of uint32 (the tests compare) */
static PyObject *words(PyObject *self, PyObject *args) {
    unsigned long long seed, epoch, index;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "KKKn", &seed, &epoch, &index, &count))
        return NULL;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "words: count below 0");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL)
        return NULL;
    uint32_t *w = (uint32_t *)PyBytes_AS_STRING(out);
    mt_state st;
    seed_sample(&st, seed, epoch, index);
    for (Py_ssize_t k = 0; k < count; k++)
        w[k] = next32(&st);
    return out;
}

static PyMethodDef methods[] = {
    {"words", words, METH_VARARGS, "The first count outputs of the (seed, epoch, index) generator."},
    {"rrc", rrc, METH_VARARGS, "RandomResizedCrop's (top, left, h, w) and a flip per sample, into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_draws", NULL, -1, methods};

PyMODINIT_FUNC PyInit__draws(void) {
    mt_state s;
    init_genrand(&s, 19650218U);
    memcpy(base_state, s.mt, sizeof(base_state));
    return PyModule_Create(&module);
}
