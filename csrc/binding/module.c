/* The Python module attn_qat._C. Importing it loads this library, whose static initializers
   register the attn_qat ops with PyTorch's op registry (registry.cpp); the module says how it was built, holds the
   kernel options (attn_qat.h; attn_qat.ops.kernel_options is their Python face) and exports the decisions the C side
   makes that Python must know: the modes and their flags, the causal codes, the head dims, the layout rule of new
   tensors and the Hopper kernels' tile shapes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "attn_qat.h"
#include "sm90/tile_shapes.h"

#ifdef AQ_WITH_CUDA
#define AQ_HAS_CUDA_KERNELS 1
#else
#define AQ_HAS_CUDA_KERNELS 0
#endif

/* kernel_options() -> (sm90, tail_split mode, forced_tail, forced_splits, decode_variant, decode_chunk, index_order,
   pad_head_dims, sm90_d256), as aq_kernel_options holds them. */
static PyObject *kernel_options(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    const aq_kernel_options o = aq_get_kernel_options();
    return Py_BuildValue("(iiLLiLiii)", o.sm90, (int)o.tail_split, (long long)o.forced_tail,
                         (long long)o.forced_splits, o.decode_variant, (long long)o.decode_chunk, o.index_order,
                         o.pad_head_dims, o.sm90_d256);
}

/* set_kernel_options(sm90, tail_split mode, forced_tail, forced_splits, decode_variant, decode_chunk, index_order,
   pad_head_dims, sm90_d256); attn_qat/ops.py checks the values. */
static PyObject *set_kernel_options(PyObject *self, PyObject *args) {
    (void)self;
    int sm90 = 1, mode = AQ_TAIL_SPLIT_AUTO, variant = -1, index_order = 0, pad = -1, d256 = 0;
    long long tail = 0, splits = 0, chunk = 0;
    if (!PyArg_ParseTuple(args, "iiLLiLiii", &sm90, &mode, &tail, &splits, &variant, &chunk, &index_order, &pad,
                          &d256))
        return NULL;
    if (mode < AQ_TAIL_SPLIT_AUTO || mode > AQ_TAIL_SPLIT_FORCED) {
        PyErr_SetString(PyExc_ValueError, "attn_qat._C.set_kernel_options: bad tail_split mode");
        return NULL;
    }
    if (variant < -1 || variant >= AQ_DECODE_VARIANTS || (chunk != 0 && !aq_decode_chunk_valid(chunk))) {
        PyErr_SetString(PyExc_ValueError, "attn_qat._C.set_kernel_options: bad decode variant or chunk");
        return NULL;
    }
    if (pad < -1 || pad > 1) {
        PyErr_SetString(PyExc_ValueError, "attn_qat._C.set_kernel_options: bad pad_head_dims");
        return NULL;
    }
    const aq_kernel_options o = {sm90 != 0,        (aq_tail_split_mode)mode, tail, splits, variant, chunk,
                                 index_order != 0, pad,                    d256 != 0};
    aq_set_kernel_options(&o);
    Py_RETURN_NONE;
}

/* Python's a > b and a < b, for AQ_TOKEN_MAJOR_RULE: torch's symbolic sizes (torch.SymInt) answer them with a guard
   on the relation, where reading their values would fix the sizes. An error sets *failed (then nothing is compared). */
static int py_compare(PyObject *a, PyObject *b, int op, int *failed) {
    const int r = *failed ? 0 : PyObject_RichCompareBool(a, b, op);
    if (r < 0) *failed = 1;
    return r > 0;
}
static PyObject *one;
/* for token_major's body, whose `failed` they set; the rule compares only with 1 */
#define PY_GREATER(a, literal_one) py_compare(a, one, Py_GT, &failed)
#define PY_LESS(a, b) py_compare(a, b, Py_LT, &failed)

/* token_major(heads, tokens, head_stride, token_stride) -> bool: attn_qat.h's rule on Python numbers, for the fake
   kernels (which see torch.SymInt sizes under torch.compile). */
static PyObject *token_major(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *heads, *tokens, *head_stride, *token_stride;
    if (!PyArg_ParseTuple(args, "OOOO", &heads, &tokens, &head_stride, &token_stride)) return NULL;
    int failed = 0;
    const int result = AQ_TOKEN_MAJOR_RULE(PY_GREATER, PY_LESS, heads, tokens, head_stride, token_stride);
    if (failed) return NULL;
    return PyBool_FromLong(result);
}

/* A tuple of n objects from make(i), or NULL with the error set. */
static PyObject *tuple_of(Py_ssize_t n, PyObject *(*make)(Py_ssize_t)) {
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t && i < n; i++) {
        PyObject *item = make(i);
        if (!item) Py_CLEAR(t);
        else PyTuple_SetItem(t, i, item);
    }
    return t;
}

static PyObject *mode_name(Py_ssize_t code) { return PyUnicode_FromString(aq_mode_of(code)->name); }
static PyObject *mode_flags(Py_ssize_t code) { return PyLong_FromUnsignedLong(aq_mode_of(code)->flags); }

/* The head dims that `supported` accepts, in increasing order. */
static PyObject *head_dims(int (*supported)(int64_t)) {
    PyObject *dims = PyList_New(0);
    for (int d = AQ_HEAD_DIM_STEP; dims && d <= AQ_HEAD_DIM_MAX; d += AQ_HEAD_DIM_STEP) {
        if (!supported(d)) continue;
        PyObject *item = PyLong_FromLong(d);
        if (!item || PyList_Append(dims, item) < 0) Py_CLEAR(dims);
        Py_XDECREF(item);
    }
    PyObject *t = dims ? PyList_AsTuple(dims) : NULL;
    Py_XDECREF(dims);
    return t;
}

/* {(head_dim, quantize_p, with_o_prime): (query rows, keys)} of the Hopper forward kernel's tiles, for the head dims
   it takes (attn_qat.h's aq_sm90_head_dims: Q/K's and V's equal). */
static PyObject *sm90_fwd_tiles(void) {
    PyObject *tiles = PyDict_New();
    for (int d = AQ_HEAD_DIM_MIN; tiles && d <= AQ_HEAD_DIM_MAX; d += AQ_HEAD_DIM_STEP) {
        if (!aq_sm90_head_dims(d, d)) continue;
        for (int quantize_p = 0; tiles && quantize_p < 2; quantize_p++) {
            for (int with_o_prime = 0; tiles && with_o_prime < 2; with_o_prime++) {
                const int nwg = sm90_consumer_warpgroups(d, quantize_p);
                PyObject *key = Py_BuildValue("(iii)", d, quantize_p, with_o_prime);
                PyObject *tile = Py_BuildValue("(ii)", 64 * nwg, sm90_keys_per_tile(d, with_o_prime, nwg));
                if (!key || !tile || PyDict_SetItem(tiles, key, tile) < 0) Py_CLEAR(tiles);
                Py_XDECREF(key);
                Py_XDECREF(tile);
            }
        }
    }
    return tiles;
}

/* Adds value (a new reference, NULL for a failure) to m as name; -1 on failure. */
static int add_object(PyObject *m, const char *name, PyObject *value) {
    if (!value) return -1;
    if (PyModule_AddObject(m, name, value) < 0) {
        Py_DECREF(value);
        return -1;
    }
    return 0;
}

static PyMethodDef attn_qat_methods[] = {
    {"kernel_options", kernel_options, METH_NOARGS, "The CUDA kernel options (sm90, tail_split mode, tail, splits, decode variant, decode chunk, index order)."},
    {"set_kernel_options", set_kernel_options, METH_VARARGS, "Set the CUDA kernel options (attn_qat.ops.kernel_options)."},
    {"token_major", token_major, METH_VARARGS, "Whether (B, H, N, D) sizes and strides are token-major."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef attn_qat_module = {
    PyModuleDef_HEAD_INIT, "_C", "attn_qat kernels; the ops live in torch.ops.attn_qat.", -1, attn_qat_methods, NULL,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    one = PyLong_FromLong(1);
    if (!one) return NULL;
    PyObject *m = PyModule_Create(&attn_qat_module);
    if (!m) return NULL;
    /* the decode options' bounds, for attn_qat.ops.kernel_options' checks and messages */
    if (PyModule_AddIntConstant(m, "with_cuda", AQ_HAS_CUDA_KERNELS) < 0 ||
        /* the head dims the attention ops and the decode op take */
        add_object(m, "HEAD_DIMS", head_dims(aq_head_dim_supported)) < 0 ||
        PyModule_AddStringConstant(m, "HEAD_DIMS_TEXT", AQ_HEAD_DIMS_TEXT) < 0 ||
        add_object(m, "DECODE_HEAD_DIMS", head_dims(aq_decode_head_dim_supported)) < 0 ||
        PyModule_AddIntConstant(m, "DECODE_VARIANTS", AQ_DECODE_VARIANTS) < 0 ||
        PyModule_AddIntConstant(m, "DECODE_CHUNK_STEP", AQ_DECODE_CHUNK_STEP) < 0 ||
        PyModule_AddIntConstant(m, "DECODE_CHUNK_MAX", AQ_DECODE_CHUNK_MAX) < 0 ||
        /* the modes by code, and the flags of what each one does */
        add_object(m, "MODES", tuple_of(AQ_MODES, mode_name)) < 0 ||
        add_object(m, "MODE_FLAGS", tuple_of(AQ_MODES, mode_flags)) < 0 ||
        PyModule_AddIntConstant(m, "QUANTIZES", AQ_QUANTIZES) < 0 ||
        PyModule_AddIntConstant(m, "BACKWARD_THROUGH_FQ", AQ_BACKWARD_THROUGH_FQ) < 0 ||
        PyModule_AddIntConstant(m, "DELTA_FROM_O_PRIME", AQ_DELTA_FROM_O_PRIME) < 0 ||
        PyModule_AddIntConstant(m, "DV_FROM_P_FQ", AQ_DV_FROM_P_FQ) < 0 ||
        PyModule_AddIntConstant(m, "BACKWARD_REDOES_STATS", AQ_BACKWARD_REDOES_STATS) < 0 ||
        PyModule_AddIntConstant(m, "CAUSAL_NONE", AQ_CAUSAL_NONE) < 0 ||
        PyModule_AddIntConstant(m, "CAUSAL_TOP_LEFT", AQ_CAUSAL_TOP_LEFT) < 0 ||
        PyModule_AddIntConstant(m, "CAUSAL_BOTTOM_RIGHT", AQ_CAUSAL_BOTTOM_RIGHT) < 0 ||
        /* the float32 log2(e) the kernels scale exponents by (attn_qat.ops.check_softmax_scale) */
        add_object(m, "LOG2E", PyFloat_FromDouble(AQ_LOG2E)) < 0 ||
        add_object(m, "SM90_FWD_TILES", sm90_fwd_tiles()) < 0 ||
        PyModule_AddIntConstant(m, "SM90_DKDV_KEYS", BWD90_KEYS) < 0 ||
        PyModule_AddIntConstant(m, "SM90_DKDV_Q_STEP", BWD90_Q_STEP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
