/* Host-to-host copies of a batch of rows, in one C call, with streaming stores.
 *
 * Built as the optional extension kvstage.kernels._host_copy (pyproject.toml, ext-modules);
 * kvstage.kernels.host_copy checks the rows and calls it.
 *
 * copy_rows(targets, sources, sizes[, stream_min_bytes]): three 1-D C-contiguous buffers of u64 (numpy uint64), one
 * entry a row: target address, source address, bytes. The caller guarantees the addresses are
 * valid for that many bytes, targets writable and no target overlapping another row's bytes
 * (kvstage.kernels.host_copy checks that); only the three buffers are checked here.
 *
 * Why: glibc's memcpy uses regular stores below glibc.cpu.x86_non_temporal_threshold (192 MiB on
 * the lead's EPYC), so 512 copies of 1 MiB pay a read-for-ownership of every target line; one
 * copy of 512 MiB streams and runs ~1.7x faster. Here a row of at least STREAM_MIN_BYTES has its
 * 16-byte-aligned (at the target) body written with SSE2 non-temporal stores (SSE2 is the x86_64
 * baseline), its head and tail with memcpy; smaller rows use memcpy. One sfence at the end orders
 * the streaming stores before the call returns. Other architectures use memcpy throughout.
 *
 * The loop runs with the GIL released for the whole batch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HOST_COPY_STREAMS 1
#define LIBRARY "SSE2 streaming stores"
#else
#define HOST_COPY_STREAMS 0
#define LIBRARY "memcpy"
#endif

/* Rows below this many bytes (the default of stream_min_bytes) are copied with memcpy. Measured
 * (bench/bench_host_copy.py --threshold): into targets not in cache, streaming wins at every row
 * size from 4 KiB up and every batch from 64 KiB to 256 MiB (32 MiB of 4 KiB rows: 5.9 -> 3.2 ms);
 * it loses (by 10-40%) only when the same small batch is rewritten while its targets are still in
 * cache, which the store's and pools' copies are not; below 4 KiB a row is mostly head and tail. */
#define STREAM_MIN_BYTES 4096

#if HOST_COPY_STREAMS
/* How far ahead of the loads the source is prefetched: 512 x 1 MiB rows 51.5 -> 44.0 ms (one
 * 512 MiB memcpy: 44.5 ms); 512 or 1024 bytes ahead measured no better. */
#define PREFETCH_BYTES 256

/* n bytes from src to dst; the 64-byte blocks from dst's first 16-byte boundary with streaming
 * stores, the rest (at most 15 + 63 bytes) with memcpy. */
static void
stream_row(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++) {
        const __m128i *s = (const __m128i *)src;
        _mm_prefetch(src + PREFETCH_BYTES, _MM_HINT_NTA);
        __m128i *d = (__m128i *)dst;
        __m128i a = _mm_loadu_si128(s);
        __m128i b = _mm_loadu_si128(s + 1);
        __m128i c = _mm_loadu_si128(s + 2);
        __m128i e = _mm_loadu_si128(s + 3);
        _mm_stream_si128(d, a);
        _mm_stream_si128(d + 1, b);
        _mm_stream_si128(d + 2, c);
        _mm_stream_si128(d + 3, e);
        src += 64;
        dst += 64;
    }
    memcpy(dst, src, n % 64);
}
#endif

/* The u64 array in buffer `view` got from `object` (argument `name`); -1 with an exception set. */
static int
get_u64(PyObject *object, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *format = view->format ? view->format : "B";
    if (*format == '=' || *format == '<' || *format == '@')
        format++;
    int unsigned_64 = view->itemsize == 8 && (strcmp(format, "Q") == 0 || strcmp(format, "L") == 0);
    if (view->ndim != 1 || !unsigned_64) {
        PyErr_Format(PyExc_ValueError, "%s: must be a 1-D buffer of uint64, got ndim %d format '%s'", name,
                     view->ndim, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
copy_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *target_object, *source_object, *size_object;
    Py_ssize_t stream_min = STREAM_MIN_BYTES;
    if (!PyArg_ParseTuple(args, "OOO|n:copy_rows", &target_object, &source_object, &size_object, &stream_min))
        return NULL;
    if (stream_min < 0) {
        PyErr_SetString(PyExc_ValueError, "stream_min_bytes: must be >= 0");
        return NULL;
    }
    Py_buffer targets, sources, sizes;
    if (get_u64(target_object, &targets, "targets") < 0)
        return NULL;
    if (get_u64(source_object, &sources, "sources") < 0) {
        PyBuffer_Release(&targets);
        return NULL;
    }
    if (get_u64(size_object, &sizes, "sizes") < 0) {
        PyBuffer_Release(&targets);
        PyBuffer_Release(&sources);
        return NULL;
    }
    Py_ssize_t rows = targets.shape[0];
    if (sources.shape[0] != rows || sizes.shape[0] != rows) {
        PyErr_Format(PyExc_ValueError, "sources, sizes: must have as many entries as targets (%zd), got %zd and %zd",
                     rows, sources.shape[0], sizes.shape[0]);
    } else {
        const uint64_t *to = targets.buf, *from = sources.buf, *bytes = sizes.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t row = 0; row < rows; row++) {
            char *dst = (char *)(uintptr_t)to[row];
            const char *src = (const char *)(uintptr_t)from[row];
            size_t n = (size_t)bytes[row];
#if HOST_COPY_STREAMS
            if (n >= (size_t)stream_min) {
                stream_row(dst, src, n);
                continue;
            }
#endif
            memcpy(dst, src, n);
        }
#if HOST_COPY_STREAMS
        _mm_sfence(); /* streaming stores are weakly ordered: make them visible before returning */
#endif
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&targets);
    PyBuffer_Release(&sources);
    PyBuffer_Release(&sizes);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(targets, sources, sizes[, stream_min_bytes]): copy sizes[i] bytes from address sources[i] to targets[i] "
     "(three 1-D uint64 buffers), the GIL released. Unchecked addresses: use kvstage.kernels.host_copy."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstage.kernels._host_copy", "Batched host-to-host row copies (streaming stores).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__host_copy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "LIBRARY", LIBRARY) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_MIN_BYTES", STREAM_MIN_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
