"""attn_qat.ops.kernel_options (README, "Kernel options"): the environment gives the options once, when the library
loads; the call sets them at once and, as a context manager, restores the previous ones. Which kernels they pick is
checked on the GPU (test_attention.py's split and mma.sync tests)."""
import os
import subprocess
import sys

import pytest

from attn_qat.ops import kernel_options

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def state(o):
    return (o.sm90, o.tail_split, o.decode_variant, o.decode_chunk, o.work_order)


VARIABLES = ("ATTN_QAT_SM90", "ATTN_QAT_TAIL_SPLIT", "ATTN_QAT_DECODE_VARIANT", "ATTN_QAT_DECODE_CHUNK",
             "ATTN_QAT_WORK_ORDER", "ATTN_QAT_PAD_HEAD_DIMS", "ATTN_QAT_SM90_D256")
NAMES = ('sm90', 'tail_split', 'decode_variant', 'decode_chunk', 'work_order')


def options_at_load(env):
    """(sm90, tail_split, decode_variant, decode_chunk, work_order) in a fresh interpreter started with these
    variables, then after changing them there."""
    code = ("import os; from attn_qat.ops import kernel_options as k; a = k(); "
            "os.environ.update(ATTN_QAT_SM90='1', ATTN_QAT_TAIL_SPLIT='3,3', ATTN_QAT_DECODE_VARIANT='1', "
            "ATTN_QAT_DECODE_CHUNK='128', ATTN_QAT_WORK_ORDER='lpt'); b = k(); "
            f"print(repr(tuple(getattr(o, n) for o in (a, b) for n in {NAMES!r})))")
    clean = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, clean.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout
    return eval(out)


@pytest.mark.slow
@pytest.mark.parametrize("env, expected", [
    ({}, (True, "auto", "auto", "auto", "lpt")),
    ({"ATTN_QAT_SM90": "0", "ATTN_QAT_TAIL_SPLIT": "5,3"}, (False, (5, 3), "auto", "auto", "lpt")),
    ({"ATTN_QAT_TAIL_SPLIT": "never"}, (True, 0, "auto", "auto", "lpt")),
    ({"ATTN_QAT_TAIL_SPLIT": ""}, (True, "auto", "auto", "auto", "lpt")),
    ({"ATTN_QAT_DECODE_VARIANT": "0", "ATTN_QAT_DECODE_CHUNK": "512"}, (True, "auto", 0, 512, "lpt")),
    ({"ATTN_QAT_DECODE_VARIANT": "7", "ATTN_QAT_DECODE_CHUNK": "100"}, (True, "auto", "auto", "auto", "lpt")),
    ({"ATTN_QAT_WORK_ORDER": "index"}, (True, "auto", "auto", "auto", "index")),
    ({"ATTN_QAT_WORK_ORDER": "longest"}, (True, "auto", "auto", "auto", "lpt")),
])
def test_environment_is_read_once_at_load(env, expected):
    at_load = options_at_load(env)
    assert at_load[:5] == expected
    assert at_load[5:] == expected, "the environment was read again after the library loaded"


@pytest.mark.slow
@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("yes", False)])
def test_sm90_d256_from_the_environment(value, expected):
    clean = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, clean.get("PYTHONPATH")]))
    code = "from attn_qat.ops import kernel_options as k; print(k().sm90_d256)"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "ATTN_QAT_SM90_D256": value},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(expected)


def test_call_sets_and_context_restores(kernel_options):
    before = kernel_options()
    with kernel_options(sm90=False, tail_split=(5, 3)) as inside:
        assert (inside.sm90, inside.tail_split) == (False, (5, 3))
        kernel_options(tail_split=0)  # outside any `with`: applies at once, leaves sm90 alone
        now = kernel_options()
        assert (now.sm90, now.tail_split) == (False, 0)
        with kernel_options(tail_split="auto"):
            assert kernel_options().tail_split == "auto"
        assert kernel_options().tail_split == 0
        with kernel_options(decode_variant=0, decode_chunk=256) as decode:
            assert (decode.decode_variant, decode.decode_chunk, decode.tail_split) == (0, 256, 0)
        assert (kernel_options().decode_variant, kernel_options().decode_chunk) == (before.decode_variant,
                                                                                     before.decode_chunk)
        with kernel_options(work_order="index") as order:
            assert (order.work_order, order.tail_split) == ("index", 0)
        assert kernel_options().work_order == before.work_order
    after = kernel_options()
    assert state(after) == state(before)


@pytest.mark.parametrize("bad", [dict(sm90=1), dict(sm90="0"), dict(tail_split="5,3"), dict(tail_split=1),
                                 dict(tail_split=(5, -1)), dict(tail_split=(5, 3, 1)), dict(tail_split=True),
                                 dict(decode_variant=4), dict(decode_variant="3"), dict(decode_variant=True),
                                 dict(decode_chunk=100), dict(decode_chunk=8192), dict(decode_chunk=0),
                                 dict(work_order="LPT"), dict(work_order=1)])
def test_bad_values_raise_and_change_nothing(kernel_options, bad):
    before = kernel_options()
    with pytest.raises((TypeError, ValueError), match="kernel_options"):
        kernel_options(**bad)
    after = kernel_options()
    assert state(after) == state(before)
