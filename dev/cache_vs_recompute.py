"""Where greedy decoding through attn_qat.NVFP4Cache parts from recomputing the whole sequence (docs/results.md).

SmolLM2-135M (examples/finetune_lm.py's GGUF), bf16 weights under bf16 autocast, teacher-forced: the same held-out
tokens go through (a) the model's forward over the whole sequence and (b) a prefill plus one decode step a token,
and the next-token logits of the last T positions are compared. Three pairs:

- `bf16`: the model's own SDPA attention, DynamicCache against the full forward: what the rest of the model (GEMMs
  of other shapes) alone changes;
- `attn_qat`: attn_qat's FP4 inference forward on the full sequence against NVFP4Cache (prefill, then the decode
  kernel);
- `decode kernel in place`: inside (b), every layer's decode output against the forward kernel run on the same
  query and the same bf16 keys and values (V blocked along head_dim, as in the cache): the attention kernels alone,
  on the model's own activations.

    python dev/cache_vs_recompute.py --gguf PATH [--prompts 8] [--prompt-len 64] [--tokens 32]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import attn_qat  # noqa: E402
import finetune_lm as lm  # noqa: E402


def teacher_forced(model, ids, prompt_len, cache=None):
    """Next-token logits (B, T, V) float32 at positions prompt_len - 1 .. end - 2 of ids (B, prompt_len + T)."""
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        if cache is None:
            return model(input_ids=ids[:, :-1], use_cache=False).logits[:, prompt_len - 1:].float()
        keyword = lm.cache_keyword(model)
        if cache is True:
            from transformers import DynamicCache
            cache = DynamicCache()
        out = [model(input_ids=ids[:, :prompt_len], use_cache=True, logits_to_keep=1, **{keyword: cache})]
        for i in range(prompt_len, ids.shape[1] - 1):
            out.append(model(input_ids=ids[:, i:i + 1], use_cache=True, logits_to_keep=1, **{keyword: cache}))
        return torch.cat([o.logits[:, -1:].float() for o in out], dim=1)


def summary(a, b):
    diff = (a - b).abs().amax(-1)  # (B, T)
    agree = (a.argmax(-1) == b.argmax(-1)).double().mean()
    return {"max |Δ logit|": float(diff.max()), "median over positions": float(diff.median()),
            "first position": float(diff[:, 0].max()), "argmax agreement": float(agree)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model, tokenizer = lm.load_gguf_model(args.gguf, lm.GGUF_SHA256, torch.bfloat16, "cuda")
    model.eval()
    root = lm.stdlib_root()
    _, heldout = lm.corpus_files(root)
    stream, _ = lm.tokenize_files(tokenizer, root, heldout, 0.2)
    length = args.prompt_len + args.tokens + 1
    ids = lm.gather_windows(stream, lm.evenly_spaced(len(stream), args.prompts, length), length).cuda()

    results = {"bf16": summary(teacher_forced(model, ids, args.prompt_len),
                               teacher_forced(model, ids, args.prompt_len, cache=True))}
    attn_qat.prepare(model, attn_qat.QATConfig(mode="attn_qat", strict=True))
    attn_qat.convert(model)
    full = teacher_forced(model, ids, args.prompt_len)

    # every decode step of every layer against the forward kernel on the same operands
    from attn_qat.integrations.kv_cache_transformers import NVFP4CacheLayer
    layer_stats, raw = [], {}
    original = NVFP4CacheLayer.attend

    def attend(self, query, attention_mask, scale):
        key, value = self.pending
        k_all, v_all = raw.get(id(self), (None, None))
        k_all = key if k_all is None else torch.cat([k_all, key], 2)
        v_all = value if v_all is None else torch.cat([v_all, value], 2)
        raw[id(self)] = (k_all, v_all)
        out = original(self, query, attention_mask, scale)
        if query.shape[2] == 1:  # a decode step: the last query sees every key
            ref = attn_qat.attention(query, k_all, v_all, causal=False, softmax_scale=scale, layout="bhsd",
                                     v_block_axis="head_dim")
            rows_equal = (out == ref).all(-1)
            layer_stats.append((float((out.float() - ref.float()).abs().max()),
                                float((out.float() - ref.float()).abs().max() / ref.float().abs().max()),
                                float(rows_equal.double().mean())))
        return out

    NVFP4CacheLayer.attend = attend
    try:
        cache = lm_cache(model, length)
        cached = teacher_forced(model, ids, args.prompt_len, cache=cache)
    finally:
        NVFP4CacheLayer.attend = original
    results["attn_qat"] = summary(full, cached)
    stats = torch.tensor(layer_stats, dtype=torch.float64)
    results["decode kernel in place"] = {"layer-steps": len(layer_stats), "max |Δ out|": float(stats[:, 0].max()),
                                         "max |Δ out| / max |out|": float(stats[:, 1].max()),
                                         "rows bit-identical": float(stats[:, 2].mean()),
                                         "layer-steps with every row identical": float((stats[:, 2] == 1).double()
                                                                                       .mean())}
    for name, r in results.items():
        print(name, {k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()})


def lm_cache(model, length):
    from attn_qat.integrations.kv_cache_transformers import NVFP4Cache
    return NVFP4Cache(model.config, max_cache_len=length)


if __name__ == "__main__":
    main()
