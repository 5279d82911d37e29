"""No CUDA kernel spills more than dev/kernel_resources.json records (dev/kernel_resources.py): checked on the built
extension wherever it has its CUDA kernels and cuobjdump and nvcc are those of the baseline (CI builds them)."""
import importlib.util
import json
import os
import shutil

import pytest

import attn_qat

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("kernel_resources", os.path.join(HERE, "..", "dev", "kernel_resources.py"))
kernel_resources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_resources)


def test_compare_flags_spill_growth_and_missing_kernels():
    base = {"a": {"REG": 100, "STACK": 0, "LOCAL": 0}, "b": {"REG": 90, "STACK": 8, "LOCAL": 0}}
    same = json.loads(json.dumps(base))
    assert kernel_resources.compare(base, same) == ([], [])
    more_regs = dict(same, a={"REG": 120, "STACK": 0, "LOCAL": 0})
    problems, notes = kernel_resources.compare(base, more_regs)
    assert problems == [] and len(notes) == 1  # registers alone are a note
    spilled = dict(same, b={"REG": 90, "STACK": 16, "LOCAL": 0})
    assert any("spills grew: b" in p for p in kernel_resources.compare(base, spilled)[0])
    fewer = dict(same, b={"REG": 90, "STACK": 0, "LOCAL": 0})
    assert kernel_resources.compare(base, fewer)[0] == []
    assert any("gone" in p for p in kernel_resources.compare(base, {"a": base["a"]})[0])
    assert any("not in the baseline" in p for p in kernel_resources.compare(base, dict(same, c=base["a"]))[0])


@pytest.mark.skipif(not attn_qat._C.with_cuda, reason="the extension was built without its CUDA kernels")
@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="cuobjdump not found")
def test_no_kernel_spills_more_than_the_baseline():
    baseline = json.load(open(kernel_resources.BASELINE))
    if baseline["nvcc"] != kernel_resources.nvcc_release():
        pytest.skip(f"baseline of nvcc {baseline['nvcc']}, this is {kernel_resources.nvcc_release()}")
    problems, _ = kernel_resources.compare(baseline["kernels"],
                                           kernel_resources.read_resources(attn_qat._C.__file__))
    assert not problems, "\n".join(problems) + "\n(dev/kernel_resources.py --update if intended, and say why)"
