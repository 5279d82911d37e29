"""Timing and reporting helpers shared by the benchmarks: CUDA-event medians, FLOP counts and result
metadata."""
import datetime
import json
import os
import subprocess

import torch


def median_ms(fn, warmup: int = 5, repeat: int = 20) -> float:
    """Median over `repeat` back-to-back fn() calls of the GPU time between CUDA events recorded before and after
    each. The calls are queued without waiting, as a training loop queues its steps, so that once the host is
    ahead each interval holds one call's GPU work and not the host's time to reach its first launch (which, timed
    from an idle GPU, adds 0.03-0.4 ms to a multi-millisecond attention call, varying run to run:
    performance.md v16). A call whose host work outlasts its GPU work is still timed at the host's pace."""
    for _ in range(warmup):
        fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeat + 1)]
    torch.cuda.synchronize()
    fn()  # untimed: the first timed call is queued behind it, like the others
    events[0].record()
    for i in range(repeat):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    times = sorted(events[i].elapsed_time(events[i + 1]) for i in range(repeat))
    return times[len(times) // 2]


def graph_ms(fns, calls: int = 10, repeat: int = 20) -> float:
    """Median ms of one call, timing the replay of a CUDA graph of `calls` calls that cycle through `fns`: the
    GPU time of a call in a steady stream with no host launch overhead, which for kernels of tens of
    microseconds is larger than the kernel (50-60 us of Python checks and op dispatch per call on the lent
    H100 machines) and would otherwise be what gets measured. Serving stacks replay decode steps as graphs
    for the same reason."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator pools, lazy initialisation)
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    ms = median_ms(graph.replay, warmup=2, repeat=repeat) / calls
    del graph
    return ms


def timed(make_fn, sets, repeat: int = 10) -> float:
    """Median ms of a callable over alternating input sets, so that no run reads the previous run's inputs
    from L2; make_fn(set) returns the callable for that set."""
    fns = [make_fn(s) for s in sets]
    counter = [0]

    def step():
        counter[0] += 1
        fns[counter[0] % len(fns)]()

    return median_ms(step, warmup=2, repeat=repeat)


def forward_flops(b, hq, nq, nk, d, causal) -> float:
    """Attention forward FLOPs, 4·B·H·Nq·Nk·D, halved when causal (the backward is 2.5x this)."""
    return 4 * b * hq * nq * nk * d / (2 if causal else 1)


def metadata() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    # ATTN_QAT_COMMIT wins: the GPU machine gets a copy of the working tree whose .git (if any) is not this one's
    commit, dirty = os.environ.get("ATTN_QAT_COMMIT"), False
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True).strip()
            dirty = bool(subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                                 text=True).strip())
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name(0),
        "commit": commit + ("-dirty" if dirty else ""),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
    }


def write_json(path: str, payload: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


def parse_bench_args(name: str, doc: str, repeat: int, quick_help: str, add_arguments=None):
    """The options every benchmark takes (--out, --quick, --only, --repeat), and those add_arguments(parser) adds;
    exits unless a CUDA GPU is present."""
    import argparse
    import sys
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      f"{name}.json"))
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--only", default="", help="comma-separated shape names to run (default: all)")
    parser.add_argument("--repeat", type=int, default=repeat)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    args.only = [x for x in args.only.split(",") if x]
    if not torch.cuda.is_available():
        sys.exit(f"bench_{name} needs a CUDA GPU")
    return args


def selected_shapes(args, shapes: dict, quick) -> list:
    """The (name, shape) pairs to run: those of --quick's set and of --only's names (which must be shapes of this
    benchmark), all when neither is given."""
    import sys
    unknown = [x for x in args.only if x not in shapes]
    if unknown:
        sys.exit(f"--only: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(shapes)}")
    return [(n, s) for n, s in shapes.items() if (not args.quick or n in quick) and (not args.only or n in args.only)]
