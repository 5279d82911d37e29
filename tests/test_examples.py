"""CPU smoke tests of examples/train_lm.py and examples/train_wan.py: a few steps of the tiny model in four
arms, end to end; --help without transformers or diffusers; the run-size defaults on the CPU and on a GPU."""
import csv
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import hand_written_lr, importorskip

REPO = pathlib.Path(__file__).resolve().parents[1]
ARMS = ("bf16", "fp4_inference", "attn_qat", "drop_in")


def check_outputs(out, arms):
    """Per-arm CSVs with evaluations at steps 2 and 3, and a summary close to bf16 for every arm."""
    summary = json.loads((out / "summary.json").read_text())
    for arm in arms:
        with open(out / f"{arm}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        val_losses = [float(r["val_loss"]) for r in rows if r["val_loss"]]
        assert [r["step"] for r in rows if r["val_loss"]] == ["2", "3"]  # every --eval-every steps and at the end
        assert all(math.isfinite(v) for v in val_losses)
        if arm == "fp4_inference":  # evaluation only: no training columns
            assert all(r["train_loss"] == "" for r in rows)
        else:
            assert [r["step"] for r in rows] == ["1", "2", "3"]
            assert all(math.isfinite(float(r[k])) for r in rows for k in ("train_loss", "grad_norm"))
            # 3 steps: warmup max(1, 3 // 20) = 1 step, the first update already at the peak
            assert [float(r["lr"]) for r in rows] == [hand_written_lr(k, 3, 1, summary["lr"]) for k in (1, 2, 3)]

    assert set(summary["arms"]) == set(arms)
    for arm, entry in summary["arms"].items():
        assert math.isfinite(entry["final_val_loss"]) and math.isfinite(entry["gap_to_bf16"])
    assert summary["arms"]["bf16"]["gap_to_bf16"] == 0.0
    # Same seed, same data: the arms start equal and FP4 attention perturbs a 3-step tiny model only a little.
    assert all(abs(entry["gap_to_bf16"]) < 0.1 for entry in summary["arms"].values())
    return summary


@pytest.mark.slow
def test_train_lm_tiny_cpu(tmp_path):
    importorskip("transformers")
    out = tmp_path / "lm"
    cmd = [sys.executable, "examples/train_lm.py", "--size", "tiny", "--steps", "3", "--eval-every", "2",
           "--eval-batches", "1", "--batch-size", "2", "--arms", ",".join(ARMS), "--device", "cpu", "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    check_outputs(out, ARMS)


@pytest.mark.slow
def test_train_wan_tiny_cpu(tmp_path):
    importorskip("diffusers")
    out = tmp_path / "wan"
    cmd = [sys.executable, "examples/train_wan.py", "--size", "tiny", "--steps", "3", "--eval-every", "2",
           "--eval-batches", "1", "--batch-size", "2", "--arms", ",".join(ARMS), "--device", "cpu", "--cross-attention",
           "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = check_outputs(out, ARMS)
    assert summary["cross_attention"] and summary["tokens_per_video"] == 32
    if importlib.util.find_spec("matplotlib"):  # the plots need it (README's test command installs it)
        assert (out / "loss.png").exists() and (out / "grad_norm.png").exists()


# Runs a script's main with --help while transformers and diffusers cannot be imported (as if not installed).
HIDDEN_IMPORTS = """
import importlib.abc, runpy, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "diffusers"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, Hide())
for name in [m for m in sys.modules if m.split(".")[0] in ("transformers", "diffusers")]:
    del sys.modules[name]
try:
    import transformers
except ImportError:
    pass
else:
    raise SystemExit("transformers was not hidden")
sys.argv = [sys.argv[1], "--help"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("script, library", [("train_lm.py", "transformers"), ("train_wan.py", "diffusers")])
def test_help_without_transformers_or_diffusers(script, library):
    cmd = [sys.executable, "-c", HIDDEN_IMPORTS, f"examples/{script}"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    help_text = " ".join(result.stdout.split())  # argparse wraps lines at the terminal width
    assert help_text.startswith("usage: ") and "on the CPU" in help_text
    assert f'pip install -e ".[examples]" ({library}' in help_text


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, gpu, cpu", [
    # (size, steps, batch_size, eval_every, eval_batches); the CPU ones take about 2 min (LM) and 1 min (Wan),
    # all six arms, on 2 cores
    ("train_lm", ("default", 1500, 32, 150, 8), ("tiny", 300, 16, 50, 4)),
    ("train_wan", ("default", 2000, 8, 200, 4), ("tiny", 300, 8, 50, 2)),
])
def test_run_size_defaults(name, gpu, cpu):
    module = load_script(name)
    sizes = lambda args: (args.size, args.steps, args.batch_size, args.eval_every, args.eval_batches)
    assert sizes(module.parse_args(["--device", "cpu"])) == cpu
    assert sizes(module.parse_args(["--device", "cuda"])) == gpu  # parsing only: needs no GPU
    assert sizes(module.parse_args(["--device", "cpu", "--size", "default", "--steps", "7"]))[:2] == ("default", 7)
    assert module.parse_args(["--device", "cpu"]).warmup_steps == cpu[1] // 20


def schedules_in_use():
    """(steps, warmup, peak lr) of every preset and default run of the examples, and of docs/results' 1200 steps."""
    runs = {(1200, 20, 3e-4)}
    for name in ("finetune_lm", "finetune_wan"):
        for preset in load_script(name).PRESETS.values():
            runs.add((preset["steps"], preset["warmup_steps"], preset["lr"]))
            if "pretrain_steps" in preset:
                runs.add((preset["pretrain_steps"], preset["pretrain_warmup"], preset["pretrain_lr"]))
    for name in ("train_lm", "train_wan"):
        for device in ("cpu", "cuda"):
            args = load_script(name).parse_args(["--device", device])
            runs.add((args.steps, args.warmup_steps, args.lr))
    return sorted(runs)


@pytest.mark.parametrize("steps, warmup, peak", schedules_in_use())
def test_schedule_matches_the_hand_written_one(steps, warmup, peak):
    """transformers' warmup + cosine schedule, as common.warmup_cosine_schedule sets it up, gives the hand-written
    schedule's learning rate at every step: equal after warmup; in warmup within one unit in the last place of a
    double (peak * (k / w) against (peak * k) / w), and equal as float32."""
    importorskip("transformers")
    common = load_script("common")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    schedule = common.warmup_cosine_schedule(optimizer, warmup, steps)
    for step in range(1, steps + 1):
        lr, expected = schedule.get_last_lr()[0], hand_written_lr(step, steps, warmup, peak)
        assert optimizer.param_groups[0]["lr"] == lr
        if step < warmup:
            assert abs(lr - expected) <= math.ulp(expected), step
            assert torch.tensor(lr, dtype=torch.float32) == torch.tensor(expected, dtype=torch.float32), step
        else:
            assert lr == expected, step
        optimizer.step()
        schedule.step()
