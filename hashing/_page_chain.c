/* A page hash chain, from token ids to keys, in one C call.
 *
 * One source, built as two optional extensions (pyproject.toml, ext-modules):
 *   -DCHAIN_SHA256 -> kvstage.hashing._sha256_chain, scheme sglang-v1, on OpenSSL's libcrypto;
 *   -DCHAIN_XXH3   -> kvstage.hashing._xxh3_chain, scheme xxh3-128, on the xxHash header
 *                     (XXH_INLINE_ALL: Debian's libxxhash-dev at build time, nothing at run time).
 *
 * page_chain(tokens, page_size, prior, hex) does what kvstage.hashing.chain does in Python, in
 * one pass: each full page's token ids are written as u32 little-endian right after the prior
 * digest, and H(prior_i + page_i) is taken; prior_0 is the given prior (none, or one raw
 * digest), prior_i the digest of page i-1. Fusing the conversion into the page loop reads each
 * token once, from cache, instead of writing and re-reading a whole u32 copy of the input. The
 * tokens of a partial last page are checked, not hashed.
 *
 * Wide ids (sglang 0.5.23's native page hash, mem_cache/cpp_utils/hash_binding.cpp): ids may be
 * 0 <= id <= 2**63-1. A page holding an id above 2**32-1 is hashed as prior_i + 0xff + every id
 * of the page as u64 little-endian instead; the conversion notes high bits with a branch-free OR
 * and only such a page is read again. scheme xxh3-128 uses the same bytes. An id below 0 or
 * above 2**63-1 is an error.
 *
 * A 1-D C-contiguous buffer of integers (an array.array such as sglang's array('q') token
 * lists, a memoryview, a numpy array) is read in place, never copied, its format checked
 * against its item size; the loop runs with the GIL released, as hashlib does for large inputs.
 * A list or tuple of ints is read once, with the GIL held, into a u32 array that the loop then
 * hashes with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(CHAIN_SHA256)
/* Keep OpenSSL's deprecated low-level SHA-256 declarations, without their warnings. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#define DIGEST 32
#define MODULE_NAME "kvstage.hashing._sha256_chain"
#define INIT_FUNCTION PyInit__sha256_chain
#if defined(OPENSSL_NO_DEPRECATED_3_0) && !defined(CHAIN_SHA256_EVP)
#define CHAIN_SHA256_EVP 1
#endif
#elif defined(CHAIN_XXH3)
#define XXH_INLINE_ALL
#include <xxhash.h>
#define DIGEST 16
#define MODULE_NAME "kvstage.hashing._xxh3_chain"
#define INIT_FUNCTION PyInit__xxh3_chain
#else
#error "build with -DCHAIN_SHA256 or -DCHAIN_XXH3"
#endif

#if PY_BIG_ENDIAN
#error "the compiled page chains write u32 little-endian with native stores: little-endian hosts only"
#endif

#define TOKEN_BYTES 4      /* per id in a page whose ids all fit u32 */
#define WIDE_TOKEN_BYTES 8 /* per id in a page holding an id above 2**32-1 */
#define WIDE_PAGE_TAG 0xff /* hashed before a wide page's ids: 1 + 8 * page_size, an odd count */
/* Below this many input bytes the GIL stays held: releasing and re-taking it costs more than
 * the hashing (the threshold hashlib uses). */
#define GIL_RELEASE_MIN_BYTES 2048

/* ---- the hash ---------------------------------------------------------------------------- */

#if defined(CHAIN_SHA256) && defined(CHAIN_SHA256_EVP)
static EVP_MD *sha256_md = NULL; /* fetched once at import, kept for the life of the process */
#endif

/* digest = H(message). Returns 0, or -1 if the library failed. */
static inline int
hash_message(const unsigned char *message, size_t length, unsigned char *digest)
{
#if defined(CHAIN_SHA256) && defined(CHAIN_SHA256_EVP)
    return EVP_Digest(message, length, digest, NULL, sha256_md, NULL) ? 0 : -1;
#elif defined(CHAIN_SHA256)
    /* The low-level API: measured ~70 ns a page cheaper than EVP's provider dispatch. */
    SHA256_CTX context;
    if (!SHA256_Init(&context) || !SHA256_Update(&context, message, length) || !SHA256_Final(digest, &context))
        return -1;
    return 0;
#else
    /* The digest is xxHash's canonical (big-endian) form, as xxhash.xxh3_128(...).digest(). */
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits(message, length));
    memcpy(digest, canonical.digest, DIGEST);
    return 0;
#endif
}

/* ---- token ids --------------------------------------------------------------------------- */

/* Contiguous token ids of one native integer type. */
typedef struct {
    const char *data;
    Py_ssize_t count;
    int itemsize; /* 1, 2, 4 or 8 */
    int is_signed;
} token_array;

/* Token i of src as a Python int (for the error naming it). */
static PyObject *
token_value(const token_array *src, Py_ssize_t i)
{
    const char *at = src->data + i * src->itemsize;
    if (src->is_signed) {
        int64_t v;
        switch (src->itemsize) {
        case 1: { int8_t x; memcpy(&x, at, 1); v = x; break; }
        case 2: { int16_t x; memcpy(&x, at, 2); v = x; break; }
        case 4: { int32_t x; memcpy(&x, at, 4); v = x; break; }
        default: memcpy(&v, at, 8); break;
        }
        return PyLong_FromLongLong(v);
    }
    uint64_t v;
    switch (src->itemsize) {
    case 1: { uint8_t x; memcpy(&x, at, 1); v = x; break; }
    case 2: { uint16_t x; memcpy(&x, at, 2); v = x; break; }
    case 4: { uint32_t x; memcpy(&x, at, 4); v = x; break; }
    default: memcpy(&v, at, 8); break;
    }
    return PyLong_FromUnsignedLongLong(v);
}

/* What convert_tokens found in a run: every id fits u32 (written as u32), or one is wider
 * (written as the tag, then u64). An offset >= 0 is instead the first id out of range. */
#define RUN_NARROW (-1)
#define RUN_WIDE (-2)

/* Convert one run of n tokens of TYPE (at most 32 bits) to u32 at out. BAD(v) is nonzero for
 * a value below 0; the bits are OR-ed over the run and looked at once, so the loop has no
 * branch and vectorises. On a bad run, the scalar scan finds its first bad token. */
#define CONVERT_NARROW_RUN(TYPE, BAD)                                  \
    do {                                                               \
        const char *in = src->data + start * (Py_ssize_t)sizeof(TYPE); \
        uint32_t *narrow = (uint32_t *)out;                            \
        uint64_t bad = 0;                                              \
        for (Py_ssize_t j = 0; j < n; j++) {                           \
            TYPE v;                                                    \
            memcpy(&v, in + j * (Py_ssize_t)sizeof(TYPE), sizeof v);   \
            bad |= (uint64_t)(BAD);                                    \
            narrow[j] = (uint32_t)v;                                   \
        }                                                              \
        if (!bad)                                                      \
            return RUN_NARROW;                                         \
        for (Py_ssize_t j = 0; j < n; j++) {                           \
            TYPE v;                                                    \
            memcpy(&v, in + j * (Py_ssize_t)sizeof(TYPE), sizeof v);   \
            if (BAD)                                                   \
                return j;                                              \
        }                                                              \
        return RUN_NARROW;                                             \
    } while (0)

/* The same for a 64-bit TYPE: v >> 32, OR-ed branch-free over the run, is nonzero for any id
 * outside u32 (a wide one or a negative one). Only such a run is read again: the first id with
 * BAD(v) (outside 0..2**63-1) is returned, else the run is rewritten at out as the tag, then
 * u64 little-endian ids. */
#define CONVERT_WIDE_RUN(TYPE, BAD)                                                    \
    do {                                                                               \
        const char *in = src->data + start * (Py_ssize_t)sizeof(TYPE);                 \
        uint32_t *narrow = (uint32_t *)out;                                            \
        uint64_t high = 0;                                                             \
        for (Py_ssize_t j = 0; j < n; j++) {                                           \
            TYPE v;                                                                    \
            memcpy(&v, in + j * (Py_ssize_t)sizeof(TYPE), sizeof v);                   \
            high |= (uint64_t)v >> 32;                                                 \
            narrow[j] = (uint32_t)v;                                                   \
        }                                                                              \
        if (!high)                                                                     \
            return RUN_NARROW;                                                         \
        for (Py_ssize_t j = 0; j < n; j++) {                                           \
            TYPE v;                                                                    \
            memcpy(&v, in + j * (Py_ssize_t)sizeof(TYPE), sizeof v);                   \
            if (BAD)                                                                   \
                return j;                                                              \
            uint64_t wide = (uint64_t)v;                                               \
            memcpy(out + 1 + (size_t)j * WIDE_TOKEN_BYTES, &wide, WIDE_TOKEN_BYTES);   \
        }                                                                              \
        out[0] = WIDE_PAGE_TAG;                                                        \
        return RUN_WIDE;                                                               \
    } while (0)

/* Tokens [start, start + n) of src at out, as the page hash reads them. Returns RUN_NARROW (n
 * u32 written), RUN_WIDE (the tag and n u64 written: out must have room for 1 + 8 * n bytes
 * where src has 8-byte items) or the offset (from start) of the first id outside
 * 0..2**63-1; out is then partly written. */
static Py_ssize_t
convert_tokens(const token_array *src, Py_ssize_t start, Py_ssize_t n, unsigned char *out)
{
    if (src->is_signed) {
        switch (src->itemsize) {
        case 1: CONVERT_NARROW_RUN(int8_t, (uint8_t)v >> 7);
        case 2: CONVERT_NARROW_RUN(int16_t, (uint16_t)v >> 15);
        case 4: CONVERT_NARROW_RUN(int32_t, (uint32_t)v >> 31);
        default: CONVERT_WIDE_RUN(int64_t, v < 0);
        }
    }
    switch (src->itemsize) {
    case 1: CONVERT_NARROW_RUN(uint8_t, 0);
    case 2: CONVERT_NARROW_RUN(uint16_t, 0);
    case 4:
        memcpy(out, src->data + start * 4, (size_t)n * 4);
        return RUN_NARROW;
    default: CONVERT_WIDE_RUN(uint64_t, v >> 63);
    }
}

/* Bytes of the page buffer that converts up to n tokens of src: room for a wide page where an
 * item can hold a wide id. */
static size_t
page_buffer_bytes(const token_array *src, Py_ssize_t n)
{
    return src->itemsize == 8 ? 1 + (size_t)n * WIDE_TOKEN_BYTES : (size_t)n * TOKEN_BYTES;
}

/* ---- the chain --------------------------------------------------------------------------- */

/* Hash every full page of src into digests (DIGEST bytes each). block has room for DIGEST bytes
 * then page_buffer_bytes(src, min(page_size, count)). Touches no Python object (runs without
 * the GIL). Returns -1 on success, the position of the first token out of range, or -2 if the
 * hash library failed. */
static Py_ssize_t
chain_pages(const token_array *src, Py_ssize_t page_size, const unsigned char *prior, size_t prior_length,
            unsigned char *block, unsigned char *digests)
{
    unsigned char *page = block + DIGEST;
    size_t narrow_bytes = (size_t)page_size * TOKEN_BYTES;
    Py_ssize_t n_pages = src->count / page_size;
    /* The message H reads is prior + page, contiguous: the prior sits right before the page
     * (a wide page's tag included). */
    memcpy(block + DIGEST - prior_length, prior, prior_length);
    for (Py_ssize_t i = 0; i < n_pages; i++) {
        Py_ssize_t run = convert_tokens(src, i * page_size, page_size, page);
        if (run >= 0)
            return i * page_size + run;
        size_t page_bytes = run == RUN_WIDE ? 1 + (size_t)page_size * WIDE_TOKEN_BYTES : narrow_bytes;
        unsigned char *digest = digests + i * DIGEST;
        if (hash_message(block + DIGEST - prior_length, prior_length + page_bytes, digest) < 0)
            return -2;
        memcpy(block, digest, DIGEST);
        prior_length = DIGEST;
    }
    Py_ssize_t tail_start = n_pages * page_size;
    Py_ssize_t run = convert_tokens(src, tail_start, src->count - tail_start, page);
    return run >= 0 ? tail_start + run : -1;
}

/* ---- Python objects ---------------------------------------------------------------------- */

static PyObject *TokenOutOfRange = NULL; /* the module's exception class (a ValueError) */

static void
raise_out_of_range(Py_ssize_t position, PyObject *value)
{
    if (value == NULL)
        return;
    PyObject *args = Py_BuildValue("(nO)", position, value);
    if (args != NULL)
        PyErr_SetObject(TokenOutOfRange, args);
    Py_XDECREF(args);
    Py_DECREF(value);
}

/* Items [i, n) of a list or tuple, from a wide id on, as int64 ids at wide. Returns 1, 0 when
 * an item is not an exact int, -1 with TokenOutOfRange set for an id outside 0..2**63-1. */
static int
read_wide_ids(PyObject **items, Py_ssize_t i, Py_ssize_t n, int64_t *wide)
{
    for (; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item))
            return 0;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow != 0 || v < 0) {
            Py_INCREF(item);
            raise_out_of_range(i, item);
            return -1;
        }
        wide[i] = v;
    }
    return 1;
}

/* A list or tuple of exact ints as a fresh array (*out, PyMem_RawFree it): u32 ids (*itemsize
 * 4) while every id fits, the common case; int64 ids (*itemsize 8) once one is wider, the u32
 * ids read so far widened. Returns 1 on success, 0 when some item is not an exact int (the
 * caller answers NotImplemented and Python takes over: int subclasses such as bool, floats,
 * numpy scalars), -1 with an exception set. */
static int
read_int_sequence(PyObject *sequence, void **out, int *itemsize)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    uint32_t *ids = PyMem_RawMalloc(n > 0 ? (size_t)n * TOKEN_BYTES : 1);
    if (ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            PyMem_RawFree(ids);
            return 0;
        }
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        /* One compare for both a negative and a wide id: the loop stays as lean as u32 alone. */
        if (overflow != 0 || (unsigned long long)v > UINT32_MAX)
            break;
        ids[i] = (uint32_t)v;
    }
    if (i == n) {
        *out = ids;
        *itemsize = TOKEN_BYTES;
        return 1;
    }
    /* Item i is wide or out of range: read_wide_ids tells which, from it on. */
    int64_t *wide = PyMem_RawMalloc((size_t)n * WIDE_TOKEN_BYTES);
    if (wide == NULL) {
        PyMem_RawFree(ids);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < i; j++)
        wide[j] = ids[j];
    PyMem_RawFree(ids);
    int status = read_wide_ids(items, i, n, wide);
    if (status <= 0) {
        PyMem_RawFree(wide);
        return status;
    }
    *out = wide;
    *itemsize = WIDE_TOKEN_BYTES;
    return 1;
}

/* The integer type of a buffer format (struct module syntax: "l", "<I", "=q", "@n", ...): sets
 * *is_signed and returns 1 when format names one integer type whose size is itemsize, else 0
 * (floats, bools, chars, big-endian, structs, or an item size the format does not have). No
 * prefix or '@': native sizes ('l' is a C long); '=' or '<': standard sizes ('l' is 4 bytes),
 * where 'n' and 'N' do not exist. */
static int
integer_format(const char *format, Py_ssize_t itemsize, int *is_signed)
{
    if (format == NULL)
        format = "B";
    int native = 1;
    if (*format == '@')
        format++;
    else if (*format == '=' || *format == '<') { /* little-endian: this file builds only on little-endian hosts */
        native = 0;
        format++;
    }
    if (format[0] == '\0' || format[1] != '\0')
        return 0;
    Py_ssize_t size;
    switch (format[0]) {
    case 'b': case 'B': size = 1; break;
    case 'h': case 'H': size = native ? (Py_ssize_t)sizeof(short) : 2; break;
    case 'i': case 'I': size = native ? (Py_ssize_t)sizeof(int) : 4; break;
    case 'l': case 'L': size = native ? (Py_ssize_t)sizeof(long) : 4; break;
    case 'q': case 'Q': size = native ? (Py_ssize_t)sizeof(long long) : 8; break;
    case 'n': case 'N': size = native ? (Py_ssize_t)sizeof(Py_ssize_t) : 0; break;
    default: return 0;
    }
    if (size != itemsize || (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8))
        return 0;
    *is_signed = format[0] >= 'a';
    return 1;
}

/* The two lowercase hex digits of every byte value, as they lie in memory. */
static uint16_t HEX_PAIRS[256];

static void
init_hex_pairs(void)
{
    static const char hex_digits[] = "0123456789abcdef";
    for (int b = 0; b < 256; b++) {
        unsigned char pair[2] = {(unsigned char)hex_digits[b >> 4], (unsigned char)hex_digits[b & 15]};
        memcpy(&HEX_PAIRS[b], pair, 2);
    }
}

/* The list of lowercase hex keys (2 * DIGEST characters each) of n digests. */
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

PyDoc_STRVAR(page_chain_doc,
"page_chain(tokens, page_size, prior, hex, /)\n"
"--\n"
"\n"
"The chain of the full pages of tokens, from token ids to keys in one call.\n"
"\n"
"tokens: a list or tuple of ints, or a 1-D C-contiguous buffer of integers, read in place: an\n"
"array.array, memoryview, ctypes array or numpy array whose format is one integer type of 1,\n"
"2, 4 or 8 bytes, signed or unsigned, native or little-endian standard size ('q', 'l', '<i',\n"
"'=H', ...) and matches its item size. page_size: tokens per page, an int >= 1. prior: a\n"
"bytes-like object of 0 bytes (no prior) or DIGEST_SIZE bytes (a raw digest). hex: a bool.\n"
"\n"
"Page i's digest is H(prior_i + page_i), prior_0 = prior, prior_i = the digest of page i-1;\n"
"page_i is the page's ids as u32 little-endian, or, for a page holding an id above 2**32-1,\n"
"the byte 0xff and then the ids as u64 little-endian (sglang 0.5.23's native page hash).\n"
"Every id is checked, those of a partial last page too, but only full pages are hashed.\n"
"\n"
"Returns the lowercase hex keys (list of str, 2 * DIGEST_SIZE characters) if hex, else the\n"
"raw digests concatenated (bytes, DIGEST_SIZE per page); NotImplemented for tokens it does not\n"
"read (a sequence holding anything but exact ints, a buffer of another format): the caller\n"
"converts those itself. Raises TokenOutOfRange(position, value) (a ValueError) for the first\n"
"id outside 0 <= id <= 2**63-1; TypeError or ValueError naming page_size or prior; RuntimeError\n"
"if the hash library fails.");

static PyObject *
page_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError,
                     "page_chain() takes 4 positional arguments (tokens, page_size, prior, hex), got %zd", nargs);
        return NULL;
    }
    PyObject *tokens = args[0], *page_object = args[1];
    if (!PyLong_Check(page_object) || PyBool_Check(page_object)) {
        PyErr_Format(PyExc_TypeError, "page_size: must be an int, got %.200s", Py_TYPE(page_object)->tp_name);
        return NULL;
    }
    int overflow = 0;
    long long page_ll = PyLong_AsLongLongAndOverflow(page_object, &overflow);
    if (page_ll == -1 && PyErr_Occurred())
        return NULL;
    if (overflow < 0 || (overflow == 0 && page_ll < 1)) {
        PyErr_Format(PyExc_ValueError, "page_size: must be >= 1, got %R", page_object);
        return NULL;
    }
    /* A page longer than any input: no full page, so no digest (the ids are still checked). */
    Py_ssize_t page_size = (overflow > 0 || page_ll > PY_SSIZE_T_MAX / TOKEN_BYTES)
                               ? PY_SSIZE_T_MAX / TOKEN_BYTES : (Py_ssize_t)page_ll;
    int want_hex = PyObject_IsTrue(args[3]);
    if (want_hex < 0)
        return NULL;

    Py_buffer prior_view;
    if (!PyObject_CheckBuffer(args[2])) {
        PyErr_Format(PyExc_TypeError, "prior: must be a bytes-like object, got %.200s", Py_TYPE(args[2])->tp_name);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &prior_view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "prior: must be a C-contiguous bytes-like object, got a %.200s that is not",
                     Py_TYPE(args[2])->tp_name);
        return NULL;
    }
    if (prior_view.len != 0 && prior_view.len != DIGEST) {
        PyErr_Format(PyExc_ValueError, "prior: must be 0 bytes (no prior) or %d bytes (a raw digest), got %zd bytes",
                     DIGEST, prior_view.len);
        PyBuffer_Release(&prior_view);
        return NULL;
    }
    unsigned char prior[DIGEST];
    size_t prior_length = (size_t)prior_view.len;
    memcpy(prior, prior_view.buf, prior_length);
    PyBuffer_Release(&prior_view);

    /* The ids: a list/tuple read into u32 (int64 if one is wider) now, or a buffer read page by
     * page in the loop. */
    token_array src;
    void *sequence_ids = NULL;
    Py_buffer view;
    int have_view = 0;
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        int status = read_int_sequence(tokens, &sequence_ids, &src.itemsize);
        if (status <= 0)
            return status < 0 ? NULL : Py_NewRef(Py_NotImplemented);
        src.data = (const char *)sequence_ids;
        src.count = PySequence_Fast_GET_SIZE(tokens);
        src.is_signed = src.itemsize == WIDE_TOKEN_BYTES;
    }
    else {
        if (!PyObject_CheckBuffer(tokens)
            || PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear(); /* not a buffer, or not a contiguous one */
            return Py_NewRef(Py_NotImplemented);
        }
        have_view = 1;
        if (view.ndim != 1 || !integer_format(view.format, view.itemsize, &src.is_signed)) {
            PyBuffer_Release(&view);
            return Py_NewRef(Py_NotImplemented);
        }
        src.data = view.buf;
        src.itemsize = (int)view.itemsize;
        src.count = view.shape != NULL ? view.shape[0] : view.len / view.itemsize;
    }

    PyObject *result = NULL;
    Py_ssize_t n_pages = src.count / page_size;
    Py_ssize_t block_tokens = src.count < page_size ? src.count : page_size;
    unsigned char *block = PyMem_RawMalloc(DIGEST + page_buffer_bytes(&src, block_tokens));
    PyObject *digests = PyBytes_FromStringAndSize(NULL, n_pages * DIGEST);
    if (block == NULL || digests == NULL) {
        if (block == NULL)
            PyErr_NoMemory();
        goto done;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(digests);
    Py_ssize_t status;
    if (src.count * src.itemsize >= GIL_RELEASE_MIN_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        status = chain_pages(&src, page_size, prior, prior_length, block, out);
        Py_END_ALLOW_THREADS
    }
    else {
        status = chain_pages(&src, page_size, prior, prior_length, block, out);
    }
    if (status == -2)
        PyErr_SetString(PyExc_RuntimeError, "page_chain: the hash library failed");
    else if (status >= 0)
        raise_out_of_range(status, token_value(&src, status));
    else if (want_hex)
        result = hex_keys(out, n_pages);
    else
        result = Py_NewRef(digests);

done:
    Py_XDECREF(digests);
    PyMem_RawFree(block);
    PyMem_RawFree(sequence_ids);
    if (have_view)
        PyBuffer_Release(&view);
    return result;
}

static PyMethodDef chain_methods[] = {
    {"page_chain", (PyCFunction)(void (*)(void))page_chain, METH_FASTCALL, page_chain_doc},
    {NULL, NULL, 0, NULL},
};

static const char *
library_version(void)
{
#if defined(CHAIN_SHA256)
    return OpenSSL_version(OPENSSL_VERSION);
#else
    static char version[32];
    unsigned number = XXH_versionNumber();
    PyOS_snprintf(version, sizeof version, "xxHash %u.%u.%u", number / 10000, number / 100 % 100, number % 100);
    return version;
#endif
}

static int
chain_exec(PyObject *module)
{
    init_hex_pairs();
#if defined(CHAIN_SHA256) && defined(CHAIN_SHA256_EVP)
    if (sha256_md == NULL && (sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL)) == NULL) {
        PyErr_SetString(PyExc_ImportError, MODULE_NAME ": OpenSSL has no SHA256 digest");
        return -1;
    }
#endif
    if (TokenOutOfRange == NULL) {
        TokenOutOfRange = PyErr_NewExceptionWithDoc(
            MODULE_NAME ".TokenOutOfRange",
            "A token id outside 0 <= id <= 2**63-1; args = (position, value).", PyExc_ValueError, NULL);
        if (TokenOutOfRange == NULL)
            return -1;
    }
    if (PyModule_AddObjectRef(module, "TokenOutOfRange", TokenOutOfRange) < 0
        || PyModule_AddIntConstant(module, "DIGEST_SIZE", DIGEST) < 0
        || PyModule_AddStringConstant(module, "LIBRARY", library_version()) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot chain_slots[] = {
    {Py_mod_exec, chain_exec},
    {0, NULL},
};

static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = MODULE_NAME,
    .m_doc = "A page hash chain in C, from token ids to keys; see kvstage.hashing.schemes.",
    .m_size = 0,
    .m_methods = chain_methods,
    .m_slots = chain_slots,
};

PyMODINIT_FUNC
INIT_FUNCTION(void)
{
    return PyModuleDef_Init(&chain_module);
}
