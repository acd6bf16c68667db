/* kvstage.hashing._chain: the sglang-v1 (SHA-256) page chain in one C loop.
 *
 * Optional accelerator of kvstage.hashing.schemes: page i's digest is
 * SHA-256(prior_i + page_i), prior_0 the given prior (0 or 32 bytes) and prior_i the raw
 * digest of page i-1. In Python every page pays for a hashlib object (~0.9 us) that dwarfs
 * hashing the page itself (~0.25 us with SHA-NI); here a page costs the hash and little else.
 *
 * The loop runs with the GIL released (for inputs of HASH_GIL_MINSIZE bytes or more, as
 * hashlib does) on a SHA256_CTX on the stack: OpenSSL's low-level SHA-256 API, deprecated in
 * OpenSSL 3.0 but still shipped, and measured faster than EVP here (EVP_DigestInit_ex2 with a
 * reused EVP_MD_CTX and a pre-fetched EVP_MD adds ~70 ns per page through the provider
 * dispatch). Where the low-level API is compiled out (OPENSSL_NO_DEPRECATED_3_0), or with
 * -DKVSTAGE_CHAIN_EVP, the EVP path is used instead; both give the same digests.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Keep the deprecated low-level declarations, without their warnings. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/opensslv.h>
#include <openssl/sha.h>

#include <stdint.h>
#include <string.h>

#if defined(OPENSSL_NO_DEPRECATED_3_0) && !defined(KVSTAGE_CHAIN_EVP)
#define KVSTAGE_CHAIN_EVP 1
#endif

#ifdef KVSTAGE_CHAIN_EVP
#define CHAIN_API "EVP"
#else
#define CHAIN_API "SHA256 low-level"
#endif

#define DIGEST 32
/* Below this many input bytes the GIL stays held: releasing and re-taking it costs more than
 * the hashing, and under contention re-taking it can wait a whole switch interval. */
#define HASH_GIL_MINSIZE 2048

#ifdef KVSTAGE_CHAIN_EVP
static EVP_MD *sha256_md = NULL; /* fetched once at import; never freed (lives as long as the process) */
#endif

/* Hash n_pages pages of page_bytes bytes each; digests go to out (n_pages * 32 bytes).
 * Returns 0 on success, -1 on an OpenSSL failure. Touches no Python object. */
static int
chain_loop(const unsigned char *data, Py_ssize_t page_bytes, Py_ssize_t n_pages,
           const unsigned char *prior, size_t prior_len, unsigned char *out)
{
#ifdef KVSTAGE_CHAIN_EVP
    int ok = 1;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (ctx == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n_pages && ok; i++) {
        unsigned char *digest = out + i * DIGEST;
        ok = EVP_DigestInit_ex(ctx, sha256_md, NULL)
             && (prior_len == 0 || EVP_DigestUpdate(ctx, prior, prior_len))
             && EVP_DigestUpdate(ctx, data + i * page_bytes, (size_t)page_bytes)
             && EVP_DigestFinal_ex(ctx, digest, NULL);
        prior = digest;
        prior_len = DIGEST;
    }
    EVP_MD_CTX_free(ctx);
    return ok ? 0 : -1;
#else
    SHA256_CTX ctx;
    for (Py_ssize_t i = 0; i < n_pages; i++) {
        unsigned char *digest = out + i * DIGEST;
        if (!SHA256_Init(&ctx)
            || (prior_len != 0 && !SHA256_Update(&ctx, prior, prior_len))
            || !SHA256_Update(&ctx, data + i * page_bytes, (size_t)page_bytes)
            || !SHA256_Final(digest, &ctx))
            return -1;
        prior = digest;
        prior_len = DIGEST;
    }
    OPENSSL_cleanse(&ctx, sizeof(ctx));
    return 0;
#endif
}

/* Get a C-contiguous byte view of obj, or raise TypeError naming the argument. */
static int
get_bytes_view(PyObject *obj, Py_buffer *view, const char *argument)
{
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: must be a bytes-like object, got %.200s", argument, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) == 0)
        return 0;
    /* A buffer, but not one contiguous block (a strided memoryview raises BufferError, a
     * strided numpy array ValueError). */
    if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *value = PyErr_GetRaisedException();
#else
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        Py_XDECREF(type);
        Py_XDECREF(traceback);
#endif
        PyErr_Format(PyExc_TypeError, "%s: must be a C-contiguous bytes-like object, got a %.200s that is not (%S)",
                     argument, Py_TYPE(obj)->tp_name, value ? value : Py_None);
        Py_XDECREF(value);
    }
    return -1;
}

/* The two lowercase hex digits of every byte value, as they lie in memory. */
static uint16_t HEX_PAIRS[256];

static void
init_hex_pairs(void)
{
    static const char digits[] = "0123456789abcdef";
    for (int b = 0; b < 256; b++) {
        unsigned char pair[2] = {(unsigned char)digits[b >> 4], (unsigned char)digits[b & 15]};
        memcpy(&HEX_PAIRS[b], pair, 2);
    }
}

/* The list of lowercase hex keys (64-character str) of n digests. */
static PyObject *
hex_keys(const unsigned char *digests, Py_ssize_t n)
{
    PyObject *keys = PyList_New(n);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyUnicode_New(2 * DIGEST, 127);
        if (key == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        Py_UCS1 *chars = PyUnicode_1BYTE_DATA(key);
        const unsigned char *digest = digests + i * DIGEST;
        for (int j = 0; j < DIGEST; j++)
            memcpy(chars + 2 * j, &HEX_PAIRS[digest[j]], 2);
        PyList_SET_ITEM(keys, i, key);
    }
    return keys;
}

PyDoc_STRVAR(sha256_chain_doc,
"sha256_chain(data, page_bytes, prior, hex=False, /)\n"
"--\n"
"\n"
"The sglang-v1 chain of the full pages of data, hashed in one C loop.\n"
"\n"
"data: a C-contiguous bytes-like object; its full pages of page_bytes bytes each are hashed,\n"
"a partial tail (len(data) % page_bytes bytes) is ignored. page_bytes: an int >= 1.\n"
"prior: a bytes-like object of 0 bytes (no prior) or 32 bytes (a raw SHA-256 digest).\n"
"Page i's digest is SHA-256(prior_i + page_i), prior_0 = prior, prior_i = digest of page i-1.\n"
"\n"
"Returns the concatenated raw digests (bytes, 32 per page), or with hex true the list of\n"
"their lowercase hex strings (64 characters each). The hashing runs with the GIL released.\n"
"Raises TypeError (wrong type, non-contiguous buffer) or ValueError (page_bytes < 1, prior\n"
"not 0 or 32 bytes) naming the argument; RuntimeError if OpenSSL fails.");

static PyObject *
sha256_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 3 || nargs > 4) {
        PyErr_Format(PyExc_TypeError,
                     "sha256_chain() takes 3 or 4 positional arguments (data, page_bytes, prior, hex=False), got %zd",
                     nargs);
        return NULL;
    }
    PyObject *page_obj = args[1];
    if (!PyLong_Check(page_obj) || PyBool_Check(page_obj)) {
        PyErr_Format(PyExc_TypeError, "page_bytes: must be an int, got %.200s", Py_TYPE(page_obj)->tp_name);
        return NULL;
    }
    int overflow = 0;
    long long page_ll = PyLong_AsLongLongAndOverflow(page_obj, &overflow);
    if (page_ll == -1 && PyErr_Occurred())
        return NULL;
    if (overflow < 0 || (overflow == 0 && page_ll < 1)) {
        PyErr_Format(PyExc_ValueError, "page_bytes: must be >= 1, got %R", page_obj);
        return NULL;
    }
    /* A page longer than any buffer: no full page, so no digest. */
    Py_ssize_t page_bytes = (overflow > 0 || page_ll > PY_SSIZE_T_MAX) ? PY_SSIZE_T_MAX : (Py_ssize_t)page_ll;
    int want_hex = 0;
    if (nargs == 4 && (want_hex = PyObject_IsTrue(args[3])) < 0)
        return NULL;

    Py_buffer prior_view, data_view;
    if (get_bytes_view(args[2], &prior_view, "prior") < 0)
        return NULL;
    if (prior_view.len != 0 && prior_view.len != DIGEST) {
        PyErr_Format(PyExc_ValueError, "prior: must be 0 bytes (no prior) or %d bytes (a raw SHA-256 digest), got %zd bytes",
                     DIGEST, prior_view.len);
        PyBuffer_Release(&prior_view);
        return NULL;
    }
    unsigned char prior[DIGEST];
    size_t prior_len = (size_t)prior_view.len;
    memcpy(prior, prior_view.buf, prior_len);
    PyBuffer_Release(&prior_view);
    if (get_bytes_view(args[0], &data_view, "data") < 0)
        return NULL;

    Py_ssize_t n_pages = data_view.len / page_bytes;
    PyObject *digests = NULL;
    if (n_pages > PY_SSIZE_T_MAX / DIGEST)
        PyErr_NoMemory();
    else
        digests = PyBytes_FromStringAndSize(NULL, n_pages * DIGEST);
    if (digests == NULL) {
        PyBuffer_Release(&data_view);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(digests);
    int status;
    if (data_view.len >= HASH_GIL_MINSIZE) {
        Py_BEGIN_ALLOW_THREADS
        status = chain_loop(data_view.buf, page_bytes, n_pages, prior, prior_len, out);
        Py_END_ALLOW_THREADS
    }
    else {
        status = chain_loop(data_view.buf, page_bytes, n_pages, prior, prior_len, out);
    }
    PyBuffer_Release(&data_view);
    if (status < 0) {
        Py_DECREF(digests);
        PyErr_SetString(PyExc_RuntimeError, "sha256_chain: OpenSSL SHA-256 failed");
        return NULL;
    }
    if (!want_hex)
        return digests;
    PyObject *keys = hex_keys(out, n_pages);
    Py_DECREF(digests);
    return keys;
}

static PyMethodDef chain_methods[] = {
    {"sha256_chain", (PyCFunction)(void (*)(void))sha256_chain, METH_FASTCALL, sha256_chain_doc},
    {NULL, NULL, 0, NULL},
};

static int
chain_exec(PyObject *module)
{
    init_hex_pairs();
#ifdef KVSTAGE_CHAIN_EVP
    if (sha256_md == NULL) {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
        sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
        sha256_md = (EVP_MD *)EVP_sha256();
#endif
        if (sha256_md == NULL) {
            PyErr_SetString(PyExc_ImportError, "kvstage.hashing._chain: OpenSSL has no SHA256 digest");
            return -1;
        }
    }
#endif
    if (PyModule_AddIntConstant(module, "DIGEST_SIZE", DIGEST) < 0
        || PyModule_AddStringConstant(module, "OPENSSL_VERSION", OpenSSL_version(OPENSSL_VERSION)) < 0
        || PyModule_AddStringConstant(module, "API", CHAIN_API) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot chain_slots[] = {
    {Py_mod_exec, chain_exec},
    {0, NULL},
};

static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvstage.hashing._chain",
    .m_doc = "The sglang-v1 (SHA-256) page chain in C, on OpenSSL's libcrypto; see kvstage.hashing.schemes.",
    .m_size = 0,
    .m_methods = chain_methods,
    .m_slots = chain_slots,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    return PyModuleDef_Init(&chain_module);
}
