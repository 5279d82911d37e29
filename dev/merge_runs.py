"""Merges the results folders of several invocations of one fine-tuning experiment into one.

examples/finetune_lm.py and examples/finetune_wan.py keep every run as runs/<entry>_seed<seed>.json (+ .csv curves)
and each invocation's setup in runs/setup.json. Invocations that ran side by side (seeds split over processes or
GPUs, each with its own --out) are merged here, then reported once:

    python dev/merge_runs.py docs/results/NAME /tmp/lm_s0 /tmp/lm_s1 /tmp/lm_s2
    python examples/finetune_lm.py --preset h100_long --report-only --out docs/results/NAME

A run present in several folders (or already in the merged one) must be identical in each (the base entries, which
every invocation evaluates, are deterministic); a difference stops the merge before anything is written. Each
invocation's setup is added once, so the report's "invocations_consistent" compares their configurations and data
hashes.
"""
import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from finetune_common import RunStore  # noqa: E402  (the folders' layout)


def merge(out, sources):
    """Checks every source first, so that a refused merge leaves `out` as it was."""
    store = RunStore(out)
    chosen = {}  # run file name -> the first source path holding it (later ones must equal it)
    repeats = 0
    for source in sources:
        src = RunStore(source)
        if not src.runs.is_dir():
            raise SystemExit(f"merge_runs: {src.runs} is not a results folder's runs/")
        for path in sorted(src.runs.glob("*_seed*.*")):
            if path.suffix not in (".json", ".csv"):
                continue
            first = chosen.setdefault(path.name, path)
            repeats += first is not path
            earlier = store.runs / path.name
            for other in {first, earlier} - {path}:
                if other.exists() and other.read_bytes() != path.read_bytes():
                    raise SystemExit(f"merge_runs: {path.name} differs between {source} and {other.parent.parent}")
    store.runs.mkdir(parents=True, exist_ok=True)
    copied = [p for name, p in chosen.items() if not (store.runs / name).exists()]
    for path in copied:
        shutil.copy2(path, store.runs / path.name)
    for source in sources:
        for record in RunStore(source).setups():
            if record not in store.setups():  # merging a folder again adds nothing
                store.add_setup(record)
    print(f"{out}: {len(copied)} runs copied, {len(chosen) - len(copied)} already there, {repeats} repeated "
          f"identically in several sources, {len(store.setups())} invocations")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the merged results folder (created; runs already in it are kept)")
    parser.add_argument("sources", nargs="+", help="results folders of the invocations")
    args = parser.parse_args(argv)
    merge(args.out, args.sources)
    return 0


if __name__ == "__main__":
    sys.exit(main())
