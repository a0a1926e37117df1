/* coordl._jpegcrop: decode only a window of a JPEG, through libjpeg(-turbo).
 *
 * decode(data, denom, top, left, height, width)
 *     -> (pixels: bytearray, rows, cols, y0, x0, out_height, out_width)
 *
 * The image is decoded at scale 1/denom (denom in 1, 2, 4, 8: libjpeg's DCT
 * scaling) to RGB.  Of that scaled image (out_height x out_width) only rows
 * [y0, y0 + rows) and columns [x0, x0 + cols) are produced: a block that
 * covers the requested window [top, top + height) x [left, left + width).
 * Rows above and below the window are skipped (jpeg_skip_scanlines: entropy
 * decoding only, no IDCT, upsampling or colour conversion; the file is read
 * to its end, so corrupt data anywhere fails as it does in a whole decode),
 * and columns outside it are cropped away before the IDCT
 * (jpeg_crop_scanline, which starts the block at an iMCU boundary, so x0 can
 * be left of `left`).  `pixels` holds rows x cols x 3 bytes, row-major.
 *
 * Any libjpeg error, any libjpeg warning (corrupt data: the caller's full
 * decode then decides, as it did before), a CMYK/YCCK file or an unusual
 * sampling layout raises ValueError; the caller falls back to its full
 * decode.  Nothing is printed.  The GIL is released while libjpeg runs.
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

/* Phase 2, without the GIL: skip the rows above, decode the block's rows into
 * dst (rows x cols x 3), skip the rows below and finish the file.  Always destroys the
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
    /* The rows below the window are entropy-decoded only (no IDCT, upsampling
     * or colour conversion) and the file is read to its end-of-image marker,
     * as PIL's whole decode reads it: data that makes PIL fail (a broken
     * stream anywhere in the file) makes this decode fail too, whatever the
     * window.  A skip that reaches the last row decodes nothing (libjpeg just
     * marks the input finished), so the last row is read, into a row of its
     * own. */
    JDIMENSION next = job->y0 + job->rows;
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

static PyMethodDef crop_methods[] = {
    {"decode", crop_decode, METH_VARARGS,
     "decode(data, denom, top, left, height, width) -> (pixels, rows, cols, y0, x0, out_h, out_w)\n"
     "\n"
     "Decode rows [y0, y0+rows) and columns [x0, x0+cols) of a JPEG scaled by\n"
     "1/denom to RGB, covering the window (top, left, height, width) of the\n"
     "scaled image; pixels is a bytearray of rows*cols*3.  ValueError when the\n"
     "file can't be decoded this way (the caller then decodes it whole)."},
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
