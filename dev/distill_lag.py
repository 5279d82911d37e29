"""How closely does a student distilled from a lockstep teacher follow it? (examples/finetune_common.train's
distillation loop, docs/results.md.) On the CPU with the tiny Wan of finetune_wan.py's smoke preset, pretrained
for --pretrain-steps, then a bf16 student and an attn_qat_qk student each distilled for --steps from a bf16 teacher
trained beside it on the same batches; prints each one's held-out loss beside its teacher's.

    python dev/distill_lag.py            # ~2 min on two CPU cores
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import attn_qat  # noqa: E402
import finetune_common as fc  # noqa: E402
import finetune_wan as fw  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", default="150")
    parser.add_argument("--steps", default="120")
    parser.add_argument("--lr", default="1e-3")
    parser.add_argument("--pretrained", default="/tmp/wan_tiny_distill_lag.pt")
    own = parser.parse_args()
    args = fw.parse_args(["--preset", "smoke", "--device", "cpu", "--pretrained", own.pretrained,
                          "--pretrain-steps", own.pretrain_steps, "--steps", own.steps, "--eval-every", "40",
                          "--batch-size", "4", "--warmup-steps", "10", "--lr", own.lr])
    args.eval_videos, args.curve_videos = 16, 4
    task = fw.WanTask(args)
    task.setup()

    base = fc.fresh_bf16_model(task).eval()
    print(f"pretrained: held-out loss {task.heldout_losses(base).mean().item():.5f}")
    for name in ("bf16", "attn_qat_qk"):
        torch.manual_seed(0)
        teacher = fc.fresh_bf16_model(task)
        student = fc.fresh_bf16_model(task) if name == "bf16" else fc.prepare_arm(task, task.fresh_model(), name)
        rows = fc.train(task, student, "attn_qat_qk_distill", 0, args, progress=False, teacher=teacher)
        teacher.eval()
        if name != "bf16":
            attn_qat.convert(student)
        t, s = (task.heldout_losses(m).mean().item() for m in (teacher, student))
        print(f"{name} student: held-out loss {s:.5f}, its teacher's {t:.5f}; distillation loss at the first / "
              f"last step {rows[0]['distill_loss']:.2e} / {rows[-1]['distill_loss']:.2e}")


if __name__ == "__main__":
    main()
