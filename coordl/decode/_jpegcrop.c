/* coordl.decode._jpegcrop: decode only a window of a JPEG, through libjpeg(-turbo).
 *
 * decode(data, denom, top, left, height, width)
 *     -> (pixels: bytearray, rows, cols, y0, x0, out_height, out_width)
 *
 * The image is decoded at scale 1/denom (denom in 1, 2, 4, 8: libjpeg's DCT
 * scaling) to RGB.  Of that scaled image (out_height x out_width) only rows
 * [y0, y0 + rows) and columns [x0, x0 + cols) are produced: a block that
 * covers the requested window [top, top + height) x [left, left + width).
 * Rows above the window are skipped (jpeg_skip_scanlines: entropy decoding
 * only, no IDCT, upsampling or colour conversion).  Rows below it are left
 * unread when the rest of the file is plain entropy-coded data (where
 * libjpeg can only warn, so a whole decode could not fail there either),
 * else skipped too and the file read to its end, so corrupt data anywhere
 * fails as it does in a whole decode.  Columns outside the window are
 * cropped away before the IDCT
 * (jpeg_crop_scanline, which starts the block at an iMCU boundary, so x0 can
 * be left of `left`).  `pixels` holds rows x cols x 3 bytes, row-major.
 *
 * Any libjpeg error, any libjpeg warning (corrupt data: the caller's full
 * decode then decides, as it did before), a CMYK/YCCK file or an unusual
 * sampling layout raises ValueError; the caller falls back to its full
 * decode.  Nothing is printed.  The GIL is released while libjpeg runs.
 *
 * to_float(src, lut, out, flip): the fused path's uint8 -> float32 step
 * through a per-channel table (see there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
    int warned; /* a corrupt-data warning was raised */
} crop_error_mgr;

static void crop_error_exit(j_common_ptr cinfo) {
    crop_error_mgr *err = (crop_error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Warnings (msg_level -1) end the decode too: the caller's full-decode path
 * then treats the file exactly as before.  Trace messages are dropped.  Never
 * prints. */
static void crop_emit_message(j_common_ptr cinfo, int msg_level) {
    crop_error_mgr *err = (crop_error_mgr *)cinfo->err;
    if (msg_level < 0) {
        err->warned = 1;
        (*cinfo->err->format_message)(cinfo, err->message);
        longjmp(err->jump, 1);
    }
}

static void crop_output_message(j_common_ptr cinfo) { (void)cinfo; }

/* Only the layouts whose crop/skip paths are well exercised: 1 component, or
 * 3 components with luma sampled h1v1, h2v1 or h2v2 and chroma h1v1. */
static int plain_sampling(struct jpeg_decompress_struct *cinfo) {
    if (cinfo->num_components == 1)
        return cinfo->jpeg_color_space == JCS_GRAYSCALE;
    if (cinfo->num_components != 3 ||
        (cinfo->jpeg_color_space != JCS_YCbCr && cinfo->jpeg_color_space != JCS_RGB))
        return 0;
    jpeg_component_info *c = cinfo->comp_info;
    int h = c[0].h_samp_factor, v = c[0].v_samp_factor;
    if (!((h == 1 && v == 1) || (h == 2 && v == 1) || (h == 2 && v == 2)))
        return 0;
    for (int i = 1; i < 3; i++)
        if (c[i].h_samp_factor != 1 || c[i].v_samp_factor != 1)
            return 0;
    return 1;
}

typedef struct {
    /* in */
    const unsigned char *data;
    unsigned long size;
    int denom, top, left, height, width;
    /* out */
    JDIMENSION rows, cols, y0, x0, out_h, out_w;
    int unsupported;
} crop_job;

typedef struct {
    struct jpeg_decompress_struct cinfo;
    crop_error_mgr err;
} crop_state;

/* Phase 1, without the GIL (touches no Python object): header, scale, start,
 * column crop; sets the block's size.  0 on success; else -1 with the
 * decompressor destroyed and err.message set (or job->unsupported). */
static int start_window(crop_state *st, crop_job *job) {
    struct jpeg_decompress_struct *cinfo = &st->cinfo;
    crop_error_mgr *err = &st->err;

    memset(cinfo, 0, sizeof *cinfo); /* mem == NULL: destroying it before create is a no-op */
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = crop_error_exit;
    err->pub.emit_message = crop_emit_message;
    err->pub.output_message = crop_output_message;
    err->warned = 0;
    err->message[0] = '\0';
    if (setjmp(err->jump)) {
        jpeg_destroy_decompress(cinfo);
        return -1;
    }
    jpeg_create_decompress(cinfo);
    jpeg_mem_src(cinfo, job->data, job->size);
    jpeg_read_header(cinfo, TRUE);
    if (!plain_sampling(cinfo)) {
        job->unsupported = 1;
        jpeg_destroy_decompress(cinfo);
        return -1;
    }
    cinfo->out_color_space = JCS_RGB;
    cinfo->scale_num = 1;
    cinfo->scale_denom = (unsigned int)job->denom;
    cinfo->dct_method = JDCT_ISLOW;
    cinfo->do_fancy_upsampling = TRUE;
    jpeg_start_decompress(cinfo); /* a progressive file is read whole here */

    JDIMENSION out_w = cinfo->output_width, out_h = cinfo->output_height;
    if (job->top < 0 || job->left < 0 || job->height <= 0 || job->width <= 0 ||
        (JDIMENSION)job->top + (JDIMENSION)job->height > out_h ||
        (JDIMENSION)job->left + (JDIMENSION)job->width > out_w) {
        snprintf(err->message, sizeof err->message,
                 "window (top=%d, left=%d, height=%d, width=%d) outside the %ux%u image "
                 "decoded at scale 1/%d", job->top, job->left, job->height, job->width,
                 (unsigned)out_w, (unsigned)out_h, job->denom);
        jpeg_destroy_decompress(cinfo);
        return -1;
    }
    JDIMENSION x0 = (JDIMENSION)job->left, cols = (JDIMENSION)job->width;
    if (cols < out_w)
        jpeg_crop_scanline(cinfo, &x0, &cols); /* moves x0 left to an iMCU boundary */
    job->rows = (JDIMENSION)job->height;
    job->cols = cinfo->output_width;
    job->y0 = (JDIMENSION)job->top;
    job->x0 = x0;
    job->out_h = out_h;
    job->out_w = out_w;
    return 0;
}

/* True when data[0, n) is what may follow the last decoded row of a
 * sequential scan without libjpeg raising an error while reading it:
 * entropy-coded bytes, where 0xFF is followed by a stuffed 0x00, by more
 * 0xFF fill bytes or by a restart marker (RST0-RST7), ending with the
 * end-of-image marker (FF D9) as its last two bytes and nowhere before.
 * Any other marker (a table, a new frame or scan, a stray SOI or EOI)
 * returns false: the caller then reads the rest with libjpeg. */
static int rest_is_plain(const JOCTET *data, size_t n) {
    if (n < 2 || data[n - 2] != 0xFF || data[n - 1] != 0xD9)
        return 0;
    size_t end = n - 2; /* the bytes before the final EOI */
    const JOCTET *p = data, *stop = data + end;
    while (p < stop) {
        const JOCTET *ff = memchr(p, 0xFF, (size_t)(stop - p));
        if (ff == NULL)
            return 1;
        while (ff + 1 < stop && ff[1] == 0xFF) /* fill bytes */
            ff++;
        if (ff + 1 >= stop) /* FF FF... then the final EOI: fill before it */
            return 1;
        JOCTET m = ff[1];
        if (m != 0x00 && !(m >= 0xD0 && m <= 0xD7))
            return 0;
        p = ff + 2;
    }
    return 1;
}

/* Phase 2, without the GIL: skip the rows above, decode the block's rows into
 * dst (rows x cols x 3), then leave the rows below unread (the rest is plain
 * data) or skip them and finish the file.  Always destroys the
 * decompressor.  0 on success; else -1 with err.message set. */
static int read_window(crop_state *st, crop_job *job, unsigned char *dst) {
    struct jpeg_decompress_struct *cinfo = &st->cinfo;
    crop_error_mgr *err = &st->err;
    JSAMPROW *volatile rowptrs = NULL; /* volatile: freed after a longjmp */
    JSAMPROW volatile last = NULL;

    if (setjmp(err->jump)) {
        jpeg_destroy_decompress(cinfo);
        PyMem_RawFree(rowptrs);
        PyMem_RawFree(last);
        return -1;
    }
    rowptrs = PyMem_RawMalloc(sizeof(JSAMPROW) * job->rows);
    if (rowptrs == NULL) {
        snprintf(err->message, sizeof err->message, "out of memory for %u row pointers",
                 (unsigned)job->rows);
        jpeg_destroy_decompress(cinfo);
        return -1;
    }
    size_t stride = (size_t)job->cols * 3;
    for (JDIMENSION i = 0; i < job->rows; i++)
        rowptrs[i] = dst + stride * i;
    if (job->y0 > 0 && jpeg_skip_scanlines(cinfo, job->y0) != job->y0) {
        snprintf(err->message, sizeof err->message, "could not skip %u rows", (unsigned)job->y0);
        jpeg_destroy_decompress(cinfo);
        PyMem_RawFree(rowptrs);
        return -1;
    }
    JDIMENSION done = 0;
    while (done < job->rows) {
        JDIMENSION got = jpeg_read_scanlines(cinfo, rowptrs + done, job->rows - done);
        if (got == 0) { /* suspension: cannot happen with a memory source */
            snprintf(err->message, sizeof err->message, "no row %u", (unsigned)(job->y0 + done));
            jpeg_destroy_decompress(cinfo);
            PyMem_RawFree(rowptrs);
            return -1;
        }
        done += got;
    }
    /* The rows below the window.  Only markers in the data still unread can
     * make libjpeg (and so PIL's whole decode) fail there: inside
     * entropy-coded data a bad code, a missing byte or an out-of-sequence
     * restart marker is a warning, after which PIL goes on and hands back an
     * image whose rows above the damage, the window's, are these.  So when
     * the rest of the file is entropy-coded data (bytes, stuffed FF 00, fill
     * FFs, restart markers) followed by the end-of-image marker at its very
     * end, and the decoder holds no marker other than a restart, the rows
     * below are left unread (rest_is_plain).  Otherwise they are read:
     * entropy-decoded only (no IDCT, upsampling or colour conversion) and the
     * file to its end-of-image marker, as PIL's whole decode reads it, so that data that
     * makes PIL fail makes this decode fail too, whatever the window.  A skip
     * that reaches the last row decodes nothing (libjpeg just marks the input
     * finished), so the last row is read, into a row of its own. */
    JDIMENSION next = job->y0 + job->rows;
    int held = cinfo->unread_marker; /* a marker the entropy decoder ran into: only a restart is plain */
    if (next < job->out_h && (held == 0 || (held >= JPEG_RST0 && held <= JPEG_RST0 + 7)) &&
        rest_is_plain(cinfo->src->next_input_byte, cinfo->src->bytes_in_buffer)) {
        jpeg_destroy_decompress(cinfo);
        PyMem_RawFree(rowptrs);
        return 0;
    }
    if (next < job->out_h) {
        JDIMENSION gap = job->out_h - 1 - next;
        if (gap > 0 && jpeg_skip_scanlines(cinfo, gap) != gap) {
            snprintf(err->message, sizeof err->message, "could not skip %u rows", (unsigned)gap);
            jpeg_destroy_decompress(cinfo);
            PyMem_RawFree(rowptrs);
            return -1;
        }
        last = PyMem_RawMalloc(stride);
        if (last == NULL) {
            snprintf(err->message, sizeof err->message, "out of memory for one row");
            jpeg_destroy_decompress(cinfo);
            PyMem_RawFree(rowptrs);
            return -1;
        }
        rowptrs[0] = last;
        if (jpeg_read_scanlines(cinfo, rowptrs, 1) != 1) {
            snprintf(err->message, sizeof err->message, "no row %u", (unsigned)(job->out_h - 1));
            jpeg_destroy_decompress(cinfo);
            PyMem_RawFree(rowptrs);
            PyMem_RawFree(last);
            return -1;
        }
    }
    jpeg_finish_decompress(cinfo);
    jpeg_destroy_decompress(cinfo);
    PyMem_RawFree(rowptrs);
    PyMem_RawFree(last);
    return 0;
}

static PyObject *crop_decode(PyObject *self, PyObject *args) {
    Py_buffer view;
    crop_job job;
    crop_state st;
    PyObject *buf = NULL;
    int rc;
    (void)self;
    memset(&job, 0, sizeof job);
    if (!PyArg_ParseTuple(args, "y*iiiii:decode", &view, &job.denom, &job.top, &job.left,
                          &job.height, &job.width))
        return NULL;
    if (job.denom != 1 && job.denom != 2 && job.denom != 4 && job.denom != 8) {
        PyErr_Format(PyExc_ValueError, "denom should be 1, 2, 4 or 8, but got denom=%d",
                     job.denom);
        goto done;
    }
    if ((size_t)view.len > (size_t)(unsigned long)-1 || view.len < 4) {
        PyErr_Format(PyExc_ValueError, "not a JPEG: %zd bytes", view.len);
        goto done;
    }
    job.data = view.buf;
    job.size = (unsigned long)view.len;
    Py_BEGIN_ALLOW_THREADS
    rc = start_window(&st, &job);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        goto failed;
    /* the block goes straight into the bytearray handed back: no copy */
    buf = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)((size_t)job.rows * job.cols * 3));
    if (buf == NULL) {
        jpeg_destroy_decompress(&st.cinfo);
        goto done;
    }
    unsigned char *dst = (unsigned char *)PyByteArray_AS_STRING(buf);
    Py_BEGIN_ALLOW_THREADS
    rc = read_window(&st, &job, dst);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        Py_CLEAR(buf);
        goto failed;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(NIIIIII)", buf, (unsigned)job.rows, (unsigned)job.cols,
                         (unsigned)job.y0, (unsigned)job.x0, (unsigned)job.out_h,
                         (unsigned)job.out_w);
failed:
    if (job.unsupported)
        PyErr_SetString(PyExc_ValueError,
                        "colour space or sampling not handled by the window decoder");
    else
        PyErr_Format(PyExc_ValueError, "libjpeg: %s", st.err.message);
done:
    PyBuffer_Release(&view);
    return NULL;
}

/* to_float(src, lut, out, flip): out[c, y, x] = lut[c, src[c, y, x']] with
 * x' = W-1-x when flip, else x.  src: a uint8 array (C, H, W), any strides;
 * lut: C*256 float32 values, contiguous; out: a writable, C-contiguous
 * float32 buffer of C*H*W values.  One pass, no temporaries: the uint8 ->
 * float conversion (ToTensor, ToDtype, Normalize) of the fused decode path,
 * its values computed once per uint8 value into `lut` by the caller (so
 * they are the unfused path's, bit for bit).  The GIL is released. */
static PyObject *crop_to_float(PyObject *self, PyObject *args) {
    PyObject *src_obj, *lut_obj, *out_obj;
    int flip;
    Py_buffer src, lut, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOp:to_float", &src_obj, &lut_obj, &out_obj, &flip))
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(lut_obj, &lut, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&lut);
        return NULL;
    }
    Py_ssize_t C = 0, H = 0, W = 0;
    const char *why = NULL;
    if (src.ndim != 3 || src.itemsize != 1 || (src.format != NULL && strcmp(src.format, "B") != 0))
        why = "src should be a uint8 array of shape (C, H, W)";
    else {
        C = src.shape[0];
        H = src.shape[1];
        W = src.shape[2];
        if (lut.itemsize != 4 || (lut.format != NULL && strcmp(lut.format, "f") != 0) ||
            lut.len != C * 256 * 4)
            why = "lut should hold C*256 float32 values";
        else if (out.itemsize != 4 || (out.format != NULL && strcmp(out.format, "f") != 0) ||
                 out.len != C * H * W * 4)
            why = "out should hold C*H*W float32 values";
    }
    if (why != NULL) {
        PyErr_SetString(PyExc_ValueError, why);
        PyBuffer_Release(&src);
        PyBuffer_Release(&lut);
        PyBuffer_Release(&out);
        return NULL;
    }
    const unsigned char *sp = (const unsigned char *)src.buf;
    const Py_ssize_t sc = src.strides[0], sy = src.strides[1], sx = src.strides[2];
    const float *tab = (const float *)lut.buf;
    float *op = (float *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < C; c++) {
        const float *t = tab + 256 * c;
        for (Py_ssize_t y = 0; y < H; y++) {
            const unsigned char *row = sp + c * sc + y * sy;
            float *o = op + (c * H + y) * W;
            if (flip) {
                const unsigned char *r = row + (W - 1) * sx;
                for (Py_ssize_t x = 0; x < W; x++)
                    o[x] = t[r[-x * sx]];
            } else {
                for (Py_ssize_t x = 0; x < W; x++)
                    o[x] = t[row[x * sx]];
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&lut);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef crop_methods[] = {
    {"decode", crop_decode, METH_VARARGS,
     "decode(data, denom, top, left, height, width) -> (pixels, rows, cols, y0, x0, out_h, out_w)\n"
     "\n"
     "Decode rows [y0, y0+rows) and columns [x0, x0+cols) of a JPEG scaled by\n"
     "1/denom to RGB, covering the window (top, left, height, width) of the\n"
     "scaled image; pixels is a bytearray of rows*cols*3.  ValueError when the\n"
     "file can't be decoded this way (the caller then decodes it whole)."},
    {"to_float", crop_to_float, METH_VARARGS,
     "to_float(src, lut, out, flip) -> None\n"
     "\n"
     "out[c, y, x] = lut[c, src[c, y, x]] (x mirrored when flip): src a uint8\n"
     "(C, H, W) array of any strides, lut C*256 float32, out a C-contiguous\n"
     "writable float32 buffer of C*H*W.  ValueError on other shapes or types."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef crop_module = {PyModuleDef_HEAD_INIT, "coordl.decode._jpegcrop",
                                         "Window (crop-region) JPEG decode through libjpeg.", -1,
                                         crop_methods};

PyMODINIT_FUNC PyInit__jpegcrop(void) {
    PyObject *m = PyModule_Create(&crop_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "JPEG_LIB_VERSION", JPEG_LIB_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
