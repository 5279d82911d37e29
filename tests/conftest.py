"""Shared test helpers: the devices to run on, the `gpu` and `slow` markers (pyproject.toml declares them), a skip
summary grouped by reason, and fresh-random-input generators."""
import collections
import math
import os
import textwrap

# torch's OpenMP threads spin while they wait, taking the cores a busy few-core machine's other threads need: they sleep
# instead (set before torch loads; the tests' subprocesses inherit it)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import attn_qat  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NO_GPU = "no CUDA GPU (gpu marker)"


def importorskip(name: str):
    """An optional package (one of pyproject's `test` extra), or a skip that names it."""
    return pytest.importorskip(name, reason=f"optional package {name} missing (python -m pip install -e '.[test]')")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` needs one CUDA GPU, `@pytest.mark.gpu(2)` two: without them the test skips, saying why."""
    for item in items:
        marker = item.get_closest_marker("gpu")
        needed = (marker.args[0] if marker.args else 1) if marker else 0
        if GPU_COUNT < needed:
            item.add_marker(pytest.mark.skip(reason=NO_GPU if needed == 1 else f"needs {needed} CUDA GPUs"))


_deselected_slow = []


def pytest_deselected(items):
    _deselected_slow.extend(item for item in items if item.get_closest_marker("slow"))


def pytest_terminal_summary(terminalreporter):
    """Skips grouped by reason, with the files they are in, and the slow tests pyproject's `-m "not slow"` left out:
    a few lines where pytest's -rs gives one per test function."""
    files = collections.defaultdict(collections.Counter)
    for report in terminalreporter.stats.get("skipped", []):
        if isinstance(report.longrepr, tuple):
            path, _, reason = report.longrepr
            files[reason.removeprefix("Skipped: ")][os.path.basename(path)] += 1
    if _deselected_slow:
        files["slow: run with -m slow"].update(os.path.basename(item.path) for item in _deselected_slow)
    if not files:
        return
    terminalreporter.write_sep("=", "skipped or deselected, by reason")
    for reason, counts in sorted(files.items(), key=lambda kv: -kv[1].total()):
        where = ", ".join(f"{name} {n}" for name, n in counts.most_common())
        terminalreporter.write_line(textwrap.fill(f"{counts.total():4d}  {reason}: {where}", 120,
                                                  subsequent_indent=" " * 6))


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def kernel_options():
    """attn_qat.ops.kernel_options for one test: the options the test sets are undone when it ends."""
    with attn_qat.ops.kernel_options():
        yield attn_qat.ops.kernel_options


def hand_written_lr(step, steps, warmup, peak):
    """The schedule the runs in docs/results were trained with (before transformers' scheduler): linear warmup,
    then cosine decay to 10% of the peak, step counting from 1."""
    if step <= warmup:
        return peak * step / max(1, warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error, numerics.md §7; NaN fails every comparison."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
