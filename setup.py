"""Builds attn_qat._C: CUDA C kernels for sm_90a plus C CPU kernels, bound through PyTorch's op registry.

The extension uses only the LibTorch stable ABI (targeting torch 2.10) and Python's limited API
(abi3; torch's cpp_extension sets Py_LIMITED_API to Python 3.10), so one build loads in every later
torch and Python.

Environment:
  ATTN_QAT_CUDA=auto|1|0     auto (default): build the CUDA kernels when nvcc is found, torch is a CUDA build and a
                             GPU is visible (torch.cuda.is_available()); on a machine without one they would cost
                             minutes to compile and never run. 1: always (a wheel built on a GPU-less host, or CI
                             proving they compile); 0: never (the C CPU kernels only)
  ATTN_QAT_CUDA_ARCHS="90a"  space-separated SM targets for nvcc (default: 90a)
  MAX_JOBS                   parallel compile jobs (torch's cpp_extension setting)
"""
import os
import sys

from setuptools import setup

# torch guesses the CUDA toolkit from the directory above `nvcc` on PATH, which is wrong when that is a
# wrapper script (as in /usr/local/bin); the standard toolkit location wins when it exists.
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

TORCH_TARGET_VERSION = "0x020a000000000000"  # the stable ABI of torch 2.10

here = os.path.dirname(os.path.abspath(__file__))
want_cuda = os.environ.get("ATTN_QAT_CUDA", "auto").lower()
if want_cuda not in ("auto", "1", "0"):
    sys.exit(f"ATTN_QAT_CUDA must be auto, 1 or 0, not {want_cuda!r}")
has_nvcc = CUDA_HOME is not None and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
if want_cuda == "1" and not has_nvcc:
    sys.exit("ATTN_QAT_CUDA=1 but nvcc was not found: install the CUDA toolkit or set CUDA_HOME "
             "(ATTN_QAT_CUDA=0 builds the CPU kernels only)")
if want_cuda == "1" and torch.version.cuda is None:
    sys.exit(f"ATTN_QAT_CUDA=1 but torch {torch.__version__} is a CPU-only build: install a CUDA build of torch")
if want_cuda == "auto":
    # torch.cuda.is_available(): the driver's device count, no CUDA context; False without a driver
    with_cuda = has_nvcc and torch.version.cuda is not None and torch.cuda.is_available()
    if has_nvcc and not with_cuda:
        why = "no visible CUDA GPU" if torch.version.cuda else f"torch {torch.__version__} is a CPU-only build"
        print(f"attn_qat: {why}, building the C CPU kernels only (ATTN_QAT_CUDA=1 forces the CUDA kernels)",
              file=sys.stderr)
else:
    with_cuda = want_cuda == "1"
archs = os.environ.get("ATTN_QAT_CUDA_ARCHS", "90a").split()
if "90" in archs:
    # An sm_90 (not 90a) image would hold the Hopper kernels with empty bodies: wgmma and setmaxnreg exist
    # only in the arch-specific target, and the runtime would pick that image on an H100 as readily.
    sys.exit("ATTN_QAT_CUDA_ARCHS: build Hopper as 90a (its kernels need wgmma), not 90")

csrc = "csrc"
sources = [f"{csrc}/{f}" for f in ("binding/module.c", "binding/registry.cpp", "binding/quantize_ops.cpp",
                                   "binding/attention_ops.cpp", "binding/decode_op.cpp", "binding/kernel_options.cpp",
                                   "cpu/quantize_cpu.c", "cpu/attention_cpu.c", "decode/kv_append_cpu.c")]
defines = [f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}", "-DTORCH_STABLE_ONLY"]
# OpenMP runs the C CPU kernels on torch's threads (csrc/cpu/attention_cpu.c)
openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
cxx_flags = ["-O3", "-ffp-contract=off", "-fvisibility=hidden"] + openmp + defines
extension_kwargs = dict(py_limited_api=True, include_dirs=[os.path.join(here, csrc)])
if sys.platform.startswith("linux"):
    # A g++ that links libstdc++ statically (as the lent GPU machines' does) would otherwise export that copy's
    # symbols, and the loader binds some of them to torch's shared libstdc++: the two copies' locale state mixes,
    # and formatting an op's error message (a bad scale, say) crashed the interpreter. Hidden, the copy is whole.
    extension_kwargs["extra_link_args"] = ["-Wl,--exclude-libs,ALL"] + openmp

if with_cuda:
    # torch would otherwise add -gencode flags for the local GPU or its default list; we name ours.
    os.environ["TORCH_CUDA_ARCH_LIST"] = ""
    sources += [f"{csrc}/{f}" for f in ("format/quantize_cuda.cu", "attention/dispatch.cu", "sm80/attention_fwd.cu",
                                         "sm90/attention_fwd_sm90.cu", "sm80/attention_bwd.cu",
                                         "sm90/attention_bwd_sm90.cu", "decode/decode_cuda.cu",
                                         "attention/p_fp16_path.cu", "attention/backward_preprocess.cu",
                                         "decode/kv_append_cuda.cu")]
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DAQ_WITH_CUDA", "-DUSE_CUDA"] + defines
    nvcc_flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if "90a" in archs:
        nvcc_flags.append("-DAQ_BUILT_SM90A")  # the host side may launch the Hopper kernels (attention/dispatch.h)
    ext = CUDAExtension(
        "attn_qat._C", sources,
        extra_compile_args={"cxx": cxx_flags + ["-DAQ_WITH_CUDA", "-DUSE_CUDA"], "nvcc": nvcc_flags},
        **extension_kwargs)
else:
    ext = CppExtension("attn_qat._C", sources, extra_compile_args={"cxx": cxx_flags}, **extension_kwargs)


class BuildExtensionKeepingObjects(BuildExtension):
    """pip's editable build compiles in a fresh temporary folder; in build/temp ninja keeps the objects, so a second
    `pip install -e` (README's test command installs the extras so) recompiles only what changed."""

    def finalize_options(self):
        if self.build_temp is None:
            self.build_temp = os.path.join(here, "build", "temp")
        super().finalize_options()


setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtensionKeepingObjects},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
