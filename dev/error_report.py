"""Turns the JSON lines that tests/test_attention.py writes with ATTN_QAT_ERROR_LOG=path into a markdown
table: the coverage matrix with the measured relative error of each case against the float64 reference.

    ATTN_QAT_ERROR_LOG=errors.jsonl python -m pytest tests/test_attention.py
    python dev/error_report.py errors.jsonl
"""
import json
import sys


def main(path):
    rows = [json.loads(line) for line in open(path)]
    print("| device | dtype | (B, Hq, Hkv, Nq, Nk, D) | mode | causal | mask | O | rows with a P flip | dQ | dK | dV |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["device"], r["dtype"], r["shape"], r["mode"], str(r["causal"]))):
        e = r["errors"]
        print(f"| {r['device']} | {r['dtype']} | {tuple(r['shape'])} | {r['mode']} | {r['causal'] or '-'} | "
              f"{r['mask'] or '-'} | {e['out']:.1e} | {e.get('flipped_rows', 0)} | {e['dq']:.1e} | {e['dk']:.1e} | {e['dv']:.1e} |")
    worst = {k: max(r["errors"][k] for r in rows) for k in ("out", "dq", "dk", "dv")}
    print(f"\n{len(rows)} cases; worst: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


if __name__ == "__main__":
    main(sys.argv[1])
