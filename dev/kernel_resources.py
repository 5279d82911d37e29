"""Registers and spill stack of every CUDA kernel in the built extension, against dev/kernel_resources.json.

A refactor or a new feature in a kernel must not add spills silently (docs/performance.md: spills cost several
percent in the Hopper kernels). This reads `cuobjdump -res-usage` of attn_qat/_C (seconds, no GPU) and fails when a
kernel's spill stack (STACK) or local memory (LOCAL) grew, or a kernel is missing from either side. The numbers
belong to one nvcc release: under another, the check is skipped.

    python dev/kernel_resources.py            # check (exit 1 on a regression); prints what changed
    python dev/kernel_resources.py --update   # rewrite the baseline from the current build (commit it, say why)
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_resources.json")
SPILL_FIELDS = ("STACK", "LOCAL")


def nvcc_release():
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return match.group(2) if match else None


def read_resources(library):
    """{mangled kernel name: {"REG": n, "STACK": n, "LOCAL": n}} from cuobjdump -res-usage."""
    out = subprocess.run(["cuobjdump", "-res-usage", library], capture_output=True, text=True, check=True).stdout
    kernels, name = {}, None
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Function "):
            name = line[len("Function "):].rstrip(":")
        elif name is not None and line.startswith("REG:"):
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
            kernels[name] = {key: int(fields[key]) for key in ("REG",) + SPILL_FIELDS}
            name = None
    return kernels


def compare(baseline, current):
    """(problems, notes): spill growth and missing kernels are problems; register changes are notes."""
    problems, notes = [], []
    for name in sorted(set(baseline) | set(current)):
        if name not in current:
            problems.append(f"gone from the build: {name}")
        elif name not in baseline:
            problems.append(f"not in the baseline (run --update): {name} {current[name]}")
        else:
            old, new = baseline[name], current[name]
            grew = [f"{key} {old[key]} -> {new[key]}" for key in SPILL_FIELDS if new[key] > old[key]]
            if grew:
                problems.append(f"spills grew: {name}: {', '.join(grew)}")
            changed = [f"{key} {old[key]} -> {new[key]}" for key in ("REG",) + SPILL_FIELDS if new[key] != old[key]]
            if changed and not grew:
                notes.append(f"{name}: {', '.join(changed)}")
    return problems, notes


def library_path():
    import attn_qat
    return attn_qat._C.__file__


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline from the current build")
    args = parser.parse_args()
    current = read_resources(library_path())
    if args.update:
        with open(BASELINE, "w") as f:
            json.dump({"nvcc": nvcc_release(), "kernels": current}, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {BASELINE}: {len(current)} kernels, nvcc {nvcc_release()}")
        return 0
    baseline = json.load(open(BASELINE))
    if baseline["nvcc"] != nvcc_release():
        print(f"skipped: the baseline is of nvcc {baseline['nvcc']}, this is {nvcc_release()}")
        return 0
    problems, notes = compare(baseline["kernels"], current)
    for line in notes:
        print("changed:", line)
    for line in problems:
        print("FAIL:", line)
    print(f"{len(current)} kernels, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
