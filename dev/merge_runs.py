"""Merges the results folders of several invocations of one fine-tuning experiment into one.

examples/finetune_lm.py and examples/finetune_wan.py keep every run as runs/<entry>_seed<seed>.json (+ .csv curves)
and each invocation's setup in runs/setup.json. Invocations that ran side by side (seeds split over processes or
GPUs, each with its own --out) are merged here, then reported once:

    python dev/merge_runs.py docs/results/NAME /tmp/lm_s0 /tmp/lm_s1 /tmp/lm_s2
    python examples/finetune_lm.py --preset h100_long --report-only --out docs/results/NAME

A run present in several folders must be identical in each (the base entries, which every invocation evaluates,
are deterministic); a difference stops the merge. The setups are concatenated, so the report's
"invocations_consistent" compares their configurations and data hashes.
"""
import argparse
import json
import pathlib
import shutil
import sys


def merge(out, sources):
    runs = pathlib.Path(out) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    setups = json.loads((runs / "setup.json").read_text()) if (runs / "setup.json").exists() else []
    copied = same = 0
    for source in sources:
        src = pathlib.Path(source) / "runs"
        if not src.is_dir():
            raise SystemExit(f"merge_runs: {src} is not a results folder's runs/")
        if (src / "setup.json").exists():
            setups += json.loads((src / "setup.json").read_text())
        for path in sorted(src.glob("*_seed*.*")):
            if path.suffix not in (".json", ".csv"):
                continue
            target = runs / path.name
            if target.exists():
                if target.read_bytes() != path.read_bytes():
                    raise SystemExit(f"merge_runs: {path.name} differs between {source} and an earlier folder")
                same += 1
                continue
            shutil.copy2(path, target)
            copied += 1
    (runs / "setup.json").write_text(json.dumps(setups, indent=1) + "\n")
    print(f"{out}: {copied} runs copied, {same} already there and identical, {len(setups)} invocations")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the merged results folder (created; runs already in it are kept)")
    parser.add_argument("sources", nargs="+", help="results folders of the invocations")
    args = parser.parse_args(argv)
    merge(args.out, args.sources)
    return 0


if __name__ == "__main__":
    sys.exit(main())
