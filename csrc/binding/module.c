/* The Python module attn_qat._C. Importing it loads this library, whose static initializers
   register the attn_qat ops with PyTorch's op registry (ops.cpp); the module says how it was built and holds the
   kernel options (attn_qat.h; attn_qat.ops.kernel_options is their Python face). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "attn_qat.h"

#ifdef AQ_WITH_CUDA
#define AQ_HAS_CUDA_KERNELS 1
#else
#define AQ_HAS_CUDA_KERNELS 0
#endif

/* kernel_options() -> (sm90, tail_split mode, forced_tail, forced_splits, decode_variant, decode_chunk, index_order),
   as aq_kernel_options holds them. */
static PyObject *kernel_options(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    const aq_kernel_options o = aq_get_kernel_options();
    return Py_BuildValue("(iiLLiLi)", o.sm90, (int)o.tail_split, (long long)o.forced_tail, (long long)o.forced_splits,
                         o.decode_variant, (long long)o.decode_chunk, o.index_order);
}

/* set_kernel_options(sm90, tail_split mode, forced_tail, forced_splits, decode_variant, decode_chunk, index_order);
   attn_qat/ops.py checks the values. */
static PyObject *set_kernel_options(PyObject *self, PyObject *args) {
    (void)self;
    int sm90 = 1, mode = AQ_TAIL_SPLIT_AUTO, variant = -1, index_order = 0;
    long long tail = 0, splits = 0, chunk = 0;
    if (!PyArg_ParseTuple(args, "iiLLiLi", &sm90, &mode, &tail, &splits, &variant, &chunk, &index_order)) return NULL;
    if (mode < AQ_TAIL_SPLIT_AUTO || mode > AQ_TAIL_SPLIT_FORCED) {
        PyErr_SetString(PyExc_ValueError, "attn_qat._C.set_kernel_options: bad tail_split mode");
        return NULL;
    }
    if (variant < -1 || variant >= AQ_DECODE_VARIANTS || (chunk != 0 && !aq_decode_chunk_valid(chunk))) {
        PyErr_SetString(PyExc_ValueError, "attn_qat._C.set_kernel_options: bad decode variant or chunk");
        return NULL;
    }
    const aq_kernel_options o = {sm90 != 0, (aq_tail_split_mode)mode, tail, splits, variant, chunk, index_order != 0};
    aq_set_kernel_options(&o);
    Py_RETURN_NONE;
}

static PyMethodDef attn_qat_methods[] = {
    {"kernel_options", kernel_options, METH_NOARGS, "The CUDA kernel options (sm90, tail_split mode, tail, splits, decode variant, decode chunk, index order)."},
    {"set_kernel_options", set_kernel_options, METH_VARARGS, "Set the CUDA kernel options (attn_qat.ops.kernel_options)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef attn_qat_module = {
    PyModuleDef_HEAD_INIT, "_C", "attn_qat kernels; the ops live in torch.ops.attn_qat.", -1, attn_qat_methods, NULL,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&attn_qat_module);
    /* the decode options' bounds, for attn_qat.ops.kernel_options' checks and messages */
    if (m && (PyModule_AddIntConstant(m, "with_cuda", AQ_HAS_CUDA_KERNELS) < 0 ||
              PyModule_AddIntConstant(m, "DECODE_VARIANTS", AQ_DECODE_VARIANTS) < 0 ||
              PyModule_AddIntConstant(m, "DECODE_CHUNK_STEP", AQ_DECODE_CHUNK_STEP) < 0 ||
              PyModule_AddIntConstant(m, "DECODE_CHUNK_MAX", AQ_DECODE_CHUNK_MAX) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
