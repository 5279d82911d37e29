/* The Python module attn_qat._C. Importing it loads this library, whose static initializers
   register the attn_qat ops with PyTorch's op registry (ops.cpp); the module only says how it was built. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef AQ_WITH_CUDA
#define AQ_HAS_CUDA_KERNELS 1
#else
#define AQ_HAS_CUDA_KERNELS 0
#endif

static struct PyModuleDef attn_qat_module = {
    PyModuleDef_HEAD_INIT, "_C", "attn_qat kernels; the ops live in torch.ops.attn_qat.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&attn_qat_module);
    if (m && PyModule_AddIntConstant(m, "with_cuda", AQ_HAS_CUDA_KERNELS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
