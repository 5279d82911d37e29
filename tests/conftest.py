"""Shared test helpers: the devices to run on (CUDA tests skip cleanly without a GPU) and
fresh-random-input generators."""
import pytest
import torch

import attn_qat

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def kernel_options():
    """attn_qat.ops.kernel_options for one test: the options the test sets are undone when it ends."""
    with attn_qat.ops.kernel_options():
        yield attn_qat.ops.kernel_options


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error, numerics.md §7; NaN fails every comparison."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
