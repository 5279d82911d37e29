"""The step a user pays: whole models with attn_qat against the same models on torch SDPA (cuDNN, and FlashAttention-2
through SDPA's flash backend), in one process, with peak memory.

- qwen3_train_4k / qwen3_train_8k: one training step (forward, backward, AdamW step) of a Qwen3-1.7B-shaped
  `Qwen3ForCausalLM` (28 layers, 16 / 8 heads of head_dim 128, random weights, bf16) on one sequence of 4096 /
  8192 tokens; attn_qat through `attn_qat.prepare` (mode attn_qat), the others through attn_implementation="sdpa"
  under `sdpa_kernel` (cuDNN, FLASH).
- generate_b8: `generate` at batch 8, a 4096-token prompt and 128 new tokens (greedy, no early stop): attn_qat
  through `prepare` + `convert` + `attn_qat.NVFP4Cache`, against SDPA with transformers' default cache. Reports
  tokens per second (new tokens over the whole call, prefill included), the decode steps alone (the call minus
  a 1-token call) and the kernels, copies and memsets a decode step queues (torch.profiler, once after the rounds).
- generate_b8_static: the same `generate`, with the decoding steps compiled as transformers compiles them for a
  static cache (torch.compile, CUDA graphs: its default CompileConfig): attn_qat through `NVFP4Cache(static=True)`
  against SDPA with transformers' StaticCache (cache_implementation="static") and, as generate_b8's baseline, SDPA
  with the default cache (eager). One cache per arm, reset before each call, as transformers reuses its own; the
  first round's warm-up call pays the compilation.
- max_batch_32k: the largest batch whose decode step fits in GPU memory at 32768 tokens a sequence, NVFP4Cache against
  transformers' default bf16 cache (the caches filled with random K/V directly; no prefill).
- wan13b_train (when diffusers is installed): one training step of Wan 2.1 1.3B's DiT (`WanTransformer3DModel`
  with its real config, random weights, bf16, 480x832x81 frames = 32760 tokens) with diffusers' gradient
  checkpointing; attn_qat through `attn_qat.prepare`, the others through diffusers' native attention (SDPA).

Each case's time is the median of --repeat steps in each of --rounds rounds (cases in reverse order every other
round), then the median over rounds, as bench_attention.py does (the lent H100s run at their power cap).

    python benchmarks/bench_models.py [--out benchmarks/results/models.json] [--only qwen3_train_4k,...]
"""
import contextlib
import copy
import gc
import os
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_qat  # noqa: E402
from common import metadata, parse_bench_args, write_json  # noqa: E402

QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, tie_word_embeddings=True)
CASES = ("qwen3_train_4k", "qwen3_train_8k", "generate_b8", "generate_b8_static", "max_batch_32k", "wan13b_train")
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def rounds_of(arms: dict, repeat: int, rounds: int) -> dict:
    """{arm: (median ms, peak GiB)}: each arm's fn warmed up in the first round, then timed `repeat` times a round,
    the arms in reverse order every other round; an arm that raises gets None."""
    times, peaks, failed = {a: [] for a in arms}, {a: 0.0 for a in arms}, {}
    order = list(arms)
    for r in range(rounds):
        for arm in (order if r % 2 == 0 else order[::-1]):
            if arm in failed:
                continue
            try:
                if r == 0:
                    arms[arm](warm=True)
                torch.cuda.reset_peak_memory_stats()
                times[arm].append(statistics.median(wall_ms(arms[arm]) for _ in range(repeat)))
                peaks[arm] = max(peaks[arm], torch.cuda.max_memory_allocated() / 2 ** 30)
            except Exception as e:  # noqa: BLE001 (out of memory, a backend that declines the shape)
                failed[arm] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"  {arm}: failed: {failed[arm]}")
            gc.collect()
            torch.cuda.empty_cache()
    return {a: {"ms": statistics.median(times[a]) if times[a] else None, "peak_gib": peaks[a] if times[a] else None,
                "rounds_ms": times[a], "error": failed.get(a)} for a in arms}


def qwen3_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_1_7B, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)


def qwen3_train(tokens: int, repeat: int, rounds: int) -> dict:
    base = qwen3_model()
    ids = torch.randint(0, QWEN3_1_7B["vocab_size"], (1, tokens), device="cuda")
    models = {"attn_qat": attn_qat.prepare(copy.deepcopy(base)), "sdpa": base}

    def step(model, backend=None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

        def run(warm=False):
            for _ in range(2 if warm else 1):
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return run

    arms = {"attn_qat": step(models["attn_qat"])}
    arms.update({name: step(models["sdpa"], b) for name, b in BACKENDS.items()})
    return rounds_of(arms, repeat, rounds)


def cache_keyword() -> str:
    """The keyword generate() and the models take the cache by: transformers 5.24 renamed past_key_values to cache."""
    import transformers
    from packaging.version import Version
    return "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def generate_models(batch: int, prompt: int):
    """The generate cases' models and prompt: (the SDPA model, its converted attn_qat copy, token ids)."""
    base = qwen3_model().eval()
    ids = torch.randint(0, QWEN3_1_7B["vocab_size"], (batch, prompt), device="cuda")
    return base, attn_qat.convert(attn_qat.prepare(copy.deepcopy(base))).eval(), ids


def add_generate_rates(result: dict, arms, batch: int, new: int) -> None:
    """Each arm's tokens per second over its `new`-token call and its decode step (that call less the 1-token one)."""
    for arm in arms:
        full, one = result[f"{arm}_{new}"]["ms"], result[f"{arm}_1"]["ms"]
        if full is not None and one is not None:
            result[f"{arm}_{new}"]["tokens_per_s"] = batch * new / (full / 1e3)
            result[f"{arm}_{new}"]["decode_ms_per_step"] = (full - one) / (new - 1)


def generate_b8(repeat: int, rounds: int, batch: int = 8, prompt: int = 4096, new: int = 128) -> dict:
    cache_kw = cache_keyword()
    base, fp4, ids = generate_models(batch, prompt)

    def gen(model, steps, nvfp4, backend=None):
        def run(warm=False):
            kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
            if nvfp4:
                kwargs[cache_kw] = attn_qat.NVFP4Cache(model.config, max_cache_len=prompt + steps)
            with torch.no_grad(), sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return run

    arms = {}
    for steps in (new, 1):
        arms[f"attn_qat_nvfp4cache_{steps}"] = gen(fp4, steps, True)
        arms[f"sdpa_default_{steps}"] = gen(base, steps, False)
    result = rounds_of(arms, repeat, rounds)
    add_generate_rates(result, ("attn_qat_nvfp4cache", "sdpa_default"), batch, new)
    for arm, model, nvfp4 in (("attn_qat_nvfp4cache", fp4, True), ("sdpa_default", base, False)):
        if "tokens_per_s" in result[f"{arm}_{new}"]:
            result[f"{arm}_{new}"]["device_ops_per_step"] = device_ops_per_step(
                gen(model, 1, nvfp4), gen(model, 5, nvfp4), 4)
    return result


def generate_b8_static(repeat: int, rounds: int, batch: int = 8, prompt: int = 4096, new: int = 128) -> dict:
    cache_kw = cache_keyword()
    base, fp4, ids = generate_models(batch, prompt)
    nvfp4_cache = attn_qat.NVFP4Cache(fp4.config, max_cache_len=prompt + new, static=True)

    def gen(model, steps, how):
        def run(warm=False):
            kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
            if how == "nvfp4":
                nvfp4_cache.reset()
                kwargs[cache_kw] = nvfp4_cache
            elif how == "static":  # transformers keeps its StaticCache, sized for the longest call so far
                kwargs.update(cache_implementation="static")
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return run

    arms = {}
    for steps in (new, 1):
        arms[f"attn_qat_nvfp4cache_static_{steps}"] = gen(fp4, steps, "nvfp4")
        arms[f"sdpa_static_{steps}"] = gen(base, steps, "static")
        arms[f"sdpa_default_{steps}"] = gen(base, steps, "default")
    result = rounds_of(arms, repeat, rounds)
    add_generate_rates(result, ("attn_qat_nvfp4cache_static", "sdpa_static", "sdpa_default"), batch, new)
    return result


def device_ops_per_step(short, long, steps: int) -> float:
    """Kernels, copies and memsets one decode step queues on the GPU: torch.profiler's device events of `long` (a
    generate call `steps` tokens longer than `short`) less those of `short`, over `steps`. Each is a launch the host
    pays for, which is what bounds a decode step at small batch (performance.md, "Whole models")."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    counts = []
    for run in (short, long):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA))
    return (counts[1] - counts[0]) / steps


def fits(model, batch: int, context: int, nvfp4: bool) -> bool:
    """Whether one decode step of `batch` sequences runs on a cache holding `context` tokens each (random K/V written
    into the cache directly, as a prefill would leave it; no prefill activations), or the GPU runs out of memory."""
    from transformers import DynamicCache
    config, cache = model.config, None
    heads_kv, dim = config.num_key_value_heads, config.head_dim
    try:
        if nvfp4:
            cache = attn_qat.NVFP4Cache(config, max_cache_len=context + 1)
            for layer in cache.layers:
                for start in range(0, context, 4096):  # bounded bf16 staging
                    n = min(4096, context - start)
                    k, v = (torch.randn(batch, heads_kv, n, dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
                    if layer.kv is None:
                        layer.lazy_initialization(k, v)
                    layer.kv.append(k, v)
                layer.seen, layer.filled = context, True  # as a prefill leaves it: the step below decodes
        else:
            cache = DynamicCache()
            for i in range(config.num_hidden_layers):
                cache.update(*(torch.randn(batch, heads_kv, context, dim, device="cuda", dtype=torch.bfloat16)
                               for _ in "kv"), i)
        ids = torch.randint(0, config.vocab_size, (batch, 1), device="cuda")
        with torch.no_grad():
            model(input_ids=ids, **{cache_keyword(): cache}, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del cache
        gc.collect()
        torch.cuda.empty_cache()


def max_batch_32k(context: int = 32768, limit: int = 512) -> dict:
    """The largest batch whose decode step fits at `context` tokens a sequence: NVFP4Cache (attn_qat, convert)
    against transformers' default cache (SDPA), by doubling, then bisection."""
    base = qwen3_model().eval()
    fp4 = attn_qat.convert(attn_qat.prepare(copy.deepcopy(base))).eval()
    result = {}
    for arm, model, nvfp4 in (("attn_qat_nvfp4cache", fp4, True), ("sdpa_default", base, False)):
        lo, hi = 0, 1
        while hi <= limit and fits(model, hi, context, nvfp4):
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)  # the answer is at most `limit`
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(model, mid, context, nvfp4) else (lo, mid)
        result[arm] = {"max_batch": lo, "context": context, "limit": limit}
        print(f"  {arm}: largest batch {lo} at {context} tokens", flush=True)
    return result


def wan13b_train(repeat: int, rounds: int) -> dict:
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    # Wan 2.1 T2V 1.3B's transformer config
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                                  out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                                  cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024).to("cuda", torch.bfloat16)
    model.enable_gradient_checkpointing()
    frames, height, width = 21, 60, 104  # latents of 81 x 480 x 832: 21 x 30 x 52 patches = 32760 tokens
    x = torch.randn(1, 16, frames, height, width, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")
    fp4 = attn_qat.prepare(copy.deepcopy(model))

    def step(m, backend=None):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-6, foreach=True)

        def run(warm=False):
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                out = m(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
                out.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    arms = {"attn_qat": step(fp4)}
    arms.update({name: step(model, b) for name, b in BACKENDS.items()})
    return rounds_of(arms, repeat, rounds)


def main():
    args = parse_bench_args("models", __doc__, 3, "the Qwen3 cases only", lambda p: p.add_argument(
        "--rounds", type=int, default=3, help="rounds over the cases (>= 1)"))
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    unknown = [x for x in args.only if x not in CASES]
    if unknown:
        sys.exit(f"--only: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    chosen = [c for c in CASES if (not args.only or c in args.only) and (not args.quick or c.startswith("qwen3"))]
    results = {}
    for case in chosen:
        print(f"{case} ...", flush=True)
        if case == "wan13b_train":
            try:
                import diffusers  # noqa: F401
            except ImportError:
                print("  skipped: diffusers is not installed")
                continue
            results[case] = wan13b_train(args.repeat, args.rounds)
        elif case == "generate_b8":
            results[case] = generate_b8(args.repeat, args.rounds)
        elif case == "generate_b8_static":
            results[case] = generate_b8_static(args.repeat, args.rounds)
        elif case == "max_batch_32k":
            results[case] = max_batch_32k()
            continue
        else:
            results[case] = qwen3_train(int(case.split("_")[-1][:-1]) * 1024, args.repeat, args.rounds)
        gc.collect()
        torch.cuda.empty_cache()
        for arm, r in results[case].items():
            extra = "".join(f", {k} {r[k]:.2f}" for k in ("tokens_per_s", "decode_ms_per_step", "device_ops_per_step")
                            if k in r)
            ms = "failed" if r["ms"] is None else f"{r['ms']:.1f} ms, peak {r['peak_gib']:.1f} GiB"
            print(f"  {arm}: {ms}{extra}", flush=True)
    write_json(args.out, {**metadata(), "rounds": args.rounds, "repeat": args.repeat, "results": results})


if __name__ == "__main__":
    main()
