"""Where a kernel's warps wait, per stretch of SASS: a compact summary of Nsight Compute's per-instruction stall
samples (the SourceCounters section), small enough to read in a terminal or bring back from the GPU machine.

On the GPU machine (Firecracker kinds have ncu; leave the clocks alone):

    ncu --clock-control none -k regex:dkdv -c 1 --section SourceCounters --section WarpStateStats \\
        --import-source no -o $OUT/k -f python3 dev/profile_kernels.py --shape 1,8,8192,128
    ncu -i $OUT/k.ncu-rep --page source --csv --print-source sass > /tmp/source.csv
    python3 dev/ncu_summary.py /tmp/source.csv > $OUT/stalls.txt

For each kernel in the CSV: the stall reasons over all samples; the stretches between wgmma commits, wgmma
waits, branches and mbarrier waits that hold at least 1% of the samples, with their instructions per visit; and
the 25 instructions with the most samples and their two main reasons. docs/performance.md ("What bounds each kernel
now") shows what it finds; dev/README.md ("How to measure") where it fits.
"""
import csv
import sys


def kernels(rows):
    """The CSV's kernels as (name, header, rows); ncu may repeat a kernel's section, which is kept once."""
    out, seen, cur = [], set(), None
    for r in rows:
        if r and r[0] == "Kernel Name":
            cur = None if r[1] in seen else {"name": r[1], "rows": []}
            if cur is not None:
                seen.add(r[1])
                out.append(cur)
        elif cur is not None and r and r[0] == "Address":
            cur["hdr"] = r
        elif cur is not None and "hdr" in cur and len(r) >= len(cur["hdr"]):
            cur["rows"].append(r)
    return out


def summarize(k):
    idx = {h: i for i, h in enumerate(k["hdr"])}
    data = k["rows"]
    stalls = [h for h in k["hdr"] if h.startswith("stall_") and "Not Issued" not in h]
    samples = [int(r[idx["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
    executed = [int(r[idx["Instructions Executed"]] or 0) for r in data]
    source = [r[idx["Source"]].strip() for r in data]
    total = sum(samples) or 1
    print("=" * 8, k["name"][:110], f"({total} samples)")
    by_reason = {s: sum(int(r[idx[s]] or 0) for r in data) for s in stalls}
    print("  " + " ".join(f"{s[6:]}={100 * v / total:.1f}%" for s, v in sorted(by_reason.items(), key=lambda x: -x[1])[:9]))
    marks = [i for i, s in enumerate(source) if ("HGMMA" in s and "gsb0" in s) or "DEPBAR" in s or "TRYWAIT" in s
             or ("BRA" in s and executed[i] > 0)]
    start = 0
    for i in marks:
        share = sum(samples[start:i + 1])
        if share > 0.01 * total:
            visits = max(executed[start:i + 1]) or 1
            print(f"  [{start:5d},{i:5d}] {100 * share / total:5.1f}%  ~{sum(executed[start:i + 1]) / visits:.0f} "
                  f"instructions a visit, ends at: {source[i][:60]} ({100 * samples[i] / total:.1f}%)")
        start = i + 1
    for i in sorted(sorted(range(len(samples)), key=lambda i: -samples[i])[:25]):
        main = sorted(((s[6:], int(data[i][idx[s]] or 0)) for s in stalls), key=lambda x: -x[1])[:2]
        print(f"    {i:5d} {100 * samples[i] / total:4.1f}% {source[i][:58]:58s} {main}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for k in kernels(csv.reader(open(sys.argv[1]))):
        summarize(k)
