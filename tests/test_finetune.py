"""CPU tests of the fine-tuning experiments (examples/finetune_lm.py, examples/finetune_wan.py) and of
dev/split_file.sh / dev/join_file.sh, which carry the 98 MB model file to a GPU machine in parts.

A tiny Llama GGUF (2 layers, hidden 128, 2 query / 1 KV heads of head_dim 64, a byte-level BPE vocabulary of 272
tokens; Q4_1 linear weights, a Q8_0 embedding and fp32 norms, as the real SmolLM2 file has) is written here with the
gguf package and loaded through finetune_lm.load_gguf_model, the loader the experiment uses: CI covers that path
without the real file. The smoke runs go through every arm, the reports and the fake-quant vs real NVFP4 checks.
"""
import csv
import hashlib
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import hand_written_lr, importorskip

REPO = pathlib.Path(__file__).resolve().parents[1]
ARMS = ("bf16", "attn_qat", "drop_in", "high_precision_p", "low_precision_o")
ENTRIES = ("base", "base_ptq", "bf16", "ptq") + ARMS[1:]
# with the arms of numerics.md §9's Q/K transforms (trained on the data, and distilled from a bf16 teacher), and their
# PTQ entries (both experiments run them by default)
LM_ARMS = ARMS + ("attn_qat_qk", "attn_qat_qk_distill", "attn_qat_qk_distill_frozen")
LM_ENTRIES = ("base", "base_ptq", "base_ptq_qk", "bf16", "ptq", "ptq_qk") + LM_ARMS[1:]
# A few merges, so the vocabulary is a real byte-level BPE one (each merge's result is a token).
MERGES = ("Ġ Ġ", "ĠĠ ĠĠ", "e r", "i n", "s e", "l f", "se lf", "r e", "o n", "d e", "Ġ t", "a t", "e n")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def load_example(name):
    sys.path.insert(0, str(REPO / "examples"))
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def byte_alphabet():
    """GPT-2's printable stand-in for each byte (bytes_to_unicode), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def permute_qk(w, heads):
    """llama.cpp's reordering of a Q or K projection's rows for its rotary layout (transformers undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path, hidden=128, layers=2, heads=2, kv_heads=1, ffn=256, seed=0):
    """Writes the tiny Llama GGUF; returns the HF-ordered weights as the loader must give them back (float32,
    after the file's quantization)."""
    gguf = importorskip("gguf")
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    rng = np.random.default_rng(seed)
    tokens = list(SPECIAL) + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    token_types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))  # 3: control, 1: normal
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama for attn_qat tests")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)

    expected = {}

    def add_quantized(name, hf_name, w, kind, heads_for_permute=None):
        stored = permute_qk(w, heads_for_permute) if heads_for_permute else w
        data = quants.quantize(stored, kind)
        writer.add_tensor(name, data, raw_dtype=kind)
        expected[hf_name] = torch.from_numpy(quants.dequantize(quants.quantize(w, kind), kind).copy())

    def add_f32(name, hf_name, w):
        writer.add_tensor(name, w)
        expected[hf_name] = torch.from_numpy(w.copy())

    normal = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)
    add_quantized("token_embd.weight", "model.embed_tokens.weight", normal(len(tokens), hidden), Q.Q8_0)
    for i in range(layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        add_f32(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", np.ones(hidden, np.float32))
        add_quantized(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", normal(hidden, hidden), Q.Q4_1, heads)
        add_quantized(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", normal(kv_heads * head_dim, hidden),
                      Q.Q4_1, kv_heads)
        add_quantized(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", normal(kv_heads * head_dim, hidden),
                      Q.Q4_1)
        add_quantized(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", normal(hidden, hidden), Q.Q4_1)
        add_f32(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", np.ones(hidden, np.float32))
        add_quantized(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", normal(ffn, hidden), Q.Q4_1)
        add_quantized(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", normal(ffn, hidden), Q.Q4_1)
        add_quantized(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", normal(hidden, ffn), Q.Q4_1)
    add_f32("output_norm.weight", "model.norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    importorskip("transformers")
    importorskip("accelerate")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    expected = write_tiny_llama_gguf(path)
    return path, expected


def test_load_tiny_gguf(tiny_gguf):
    path, expected = tiny_gguf
    lm = load_example("finetune_lm")
    model, tokenizer = lm.load_gguf_model(path, sha256(path), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (2, 128, 2, 1, 256, 272)
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("_proj"))
    # The weights are the file's, dequantized, in transformers' order (Q and K rows un-permuted).
    state = model.state_dict()
    for name, weight in expected.items():
        assert torch.equal(state[name], weight), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # no output.weight in the file: tied

    snippet = "def f(self, x):\n    return x  # done\n"
    ids = tokenizer(snippet, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == snippet
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tokenizer.convert_tokens_to_ids("self") == len(SPECIAL) + 256 + MERGES.index("se lf")

    bf16_model, _ = lm.load_gguf_model(path, sha256(path))  # the experiment's default: bf16 weights
    assert {p.dtype for p in bf16_model.parameters()} == {torch.bfloat16}


def test_gguf_checksum_and_missing_file(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    lm = load_example("finetune_lm")
    with pytest.raises(ValueError, match="SHA-256"):
        lm.load_gguf_model(path, "0" * 64)
    with pytest.raises(FileNotFoundError, match="--gguf"):
        lm.locate_gguf(tmp_path / "absent.gguf")


def test_corpus_split_is_by_name():
    lm = load_example("finetune_lm")
    train, heldout = lm.corpus_files()
    assert heldout and not set(train) & set(heldout)
    assert set(heldout) <= set(lm.HELDOUT_FILES)
    assert not any(part in lm.EXCLUDED_DIRS for f in train for part in f.split("/")[:-1])
    assert len(lm.HELDOUT_FILES) == len(set(lm.HELDOUT_FILES))


def test_site_packages_mb_must_not_be_negative():
    lm = load_example("finetune_lm")
    with pytest.raises(SystemExit):
        lm.parse_args(["--device", "cpu", "--site-packages-mb", "-1"])
    assert lm.parse_args(["--device", "cpu", "--site-packages-mb", "2"]).site_packages_mb == 2.0


def test_site_package_files_leave_out_held_out_copies(tmp_path):
    """The extra training text never holds a held-out file's text (a vendored copy), tests or attn_qat, and its
    order is fixed."""
    lm = load_example("finetune_lm")
    stdlib = lm.stdlib_root()
    heldout = lm.corpus_files(stdlib)[1][0]
    packages = tmp_path / "site"
    for name, text in [("pkg/a.py", "a = 1\n"), ("pkg/b.py", "b = 2\n"), ("pkg/tests/t.py", "t = 3\n"),
                       ("attn_qat/x.py", "x = 4\n"), ("vendored/copy.py", (stdlib / heldout).read_text())]:
        (packages / name).parent.mkdir(parents=True, exist_ok=True)
        (packages / name).write_text(text)
    files = lm.site_package_files(packages, stdlib)
    assert sorted(files) == ["pkg/a.py", "pkg/b.py"]
    assert files == lm.site_package_files(packages, stdlib)


def test_bootstrap_intervals():
    importorskip("scipy")
    common = load_example("finetune_common")
    torch.manual_seed(0)
    boot = common.Bootstrap(400)
    x = torch.randn(400, dtype=torch.float64) + 1.0
    mean, (low, high) = boot.mean(x)
    assert low < mean < high and low < 1.0 < high  # a 95% interval around the sample mean covers the true mean
    assert abs((high - low) - 2 * 1.96 / 20) < 0.05  # about ±1.96 standard errors
    value, (low, high) = boot.ratio(2 * x, x)
    assert value == pytest.approx(2.0) and low == pytest.approx(2.0) and high == pytest.approx(2.0)
    # Every statistic resamples the same items: the mean's interval is the ratio's over a denominator of ones.
    assert boot.ratio(x, torch.ones_like(x))[1] == boot.mean(x)[1]
    with pytest.raises(ValueError, match="400 items"):
        boot.mean(x[:10])
    assert common.prefix_fraction(torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4]]),
                                  torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])).tolist() == [1.0, 0.25]


def hand_written_bootstrap(n, resamples=10_000, seed=0):
    """The paired percentile bootstrap the reports in docs/results were computed with (before scipy's): one fixed
    matrix of resampled item indices, (interval of the mean, interval of a ratio of means)."""
    index = torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed))
    interval = lambda v: torch.quantile(v, torch.tensor([0.025, 0.975], dtype=v.dtype)).tolist()
    return (lambda x: interval(x[index].mean(1)),
            lambda num, den: interval(num[index].mean(1) / den[index].mean(1)))


@pytest.mark.parametrize("n", [64, 256])
def test_bootstrap_matches_the_hand_written_one(n):
    """scipy.stats.bootstrap(paired=True) gives the hand-written bootstrap's intervals up to Monte-Carlo error (the
    two draw different resamples): each end within 5% of the interval's width, on held-out-loss-like items (a PTQ
    gap per item, and the fraction of it an arm recovers)."""
    importorskip("scipy")
    common = load_example("finetune_common")
    generator = torch.Generator().manual_seed(n)
    bf16 = 2.0 + 0.3 * torch.randn(n, generator=generator, dtype=torch.float64)
    ptq = bf16 + 0.1 + 0.02 * torch.randn(n, generator=generator, dtype=torch.float64)
    arm = bf16 + 0.06 + 0.02 * torch.randn(n, generator=generator, dtype=torch.float64)
    old_mean, old_ratio = hand_written_bootstrap(n)
    boot = common.Bootstrap(n)
    for (value, new), old, point in ((boot.mean(ptq - bf16), old_mean(ptq - bf16), (ptq - bf16).mean()),
                                     (boot.ratio(ptq - arm, ptq - bf16), old_ratio(ptq - arm, ptq - bf16),
                                      (ptq - arm).mean() / (ptq - bf16).mean())):
        assert value == float(point)  # the point estimate is the statistic itself
        width = old[1] - old[0]
        assert abs(new[0] - old[0]) < 0.05 * width and abs(new[1] - old[1]) < 0.05 * width, (new, old)


def test_epoch_windows_draw_without_replacement():
    """Training windows: every window once per epoch, a new order each epoch, the same order for the same seed."""
    lm = load_example("finetune_lm")
    stream_len, seq_len = 1000, 64  # 15 windows of 65 tokens, consecutive ones sharing a token
    windows = lm.EpochWindows(stream_len, seq_len, seed=3)
    starts = windows.starts
    assert starts.tolist() == list(range(0, stream_len - seq_len, seq_len)) and int(starts[-1]) + seq_len < stream_len
    taken = torch.cat([windows.take(4) for _ in range(15)])  # 60 = four epochs of 15, batches crossing epochs
    epochs = taken.view(4, 15)
    assert all(sorted(e.tolist()) == starts.tolist() for e in epochs) and windows.epoch == 3
    assert len({tuple(e.tolist()) for e in epochs}) == 4  # reshuffled each epoch
    again = lm.EpochWindows(stream_len, seq_len, seed=3)
    assert torch.equal(torch.cat([again.take(6) for _ in range(10)]), taken)  # batch size does not change the order
    assert not torch.equal(lm.EpochWindows(stream_len, seq_len, seed=4).take(15), epochs[0])
    # In an epoch every token after the first is predicted once: the windows' targets tile the stream.
    targets = torch.cat([torch.arange(s + 1, s + seq_len + 1) for s in epochs[0].tolist()])
    assert sorted(targets.tolist()) == list(range(1, int(starts[-1]) + seq_len + 1))
    with pytest.raises(ValueError, match="fewer than one window"):
        lm.EpochWindows(seq_len, seq_len, seed=0)


def run_script(args, timeout=600):
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def check_report(out, extra_keys, arms=ARMS, entries=ENTRIES):
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["entries"]) == set(entries)
    assert summary["environment"]["git_commit"] is None or len(summary["environment"]["git_commit"]) >= 7
    assert summary["missing"] == []
    for entry in arms[1:]:
        info = summary["entries"][entry]
        assert math.isfinite(info["loss"]) and "recovered" in info and "gap_to_bf16" in info
        assert info["grad_norm"]["mean_over_seeds"]["nonfinite"] == 0
    assert all("gap_to_base" in summary["entries"][e] for e in entries if e.startswith("base_ptq"))
    for entry in ("high_precision_p", "low_precision_o"):  # each principle's cost, paired with attn_qat
        diff = summary["entries"][entry]["diff_to_attn_qat"]
        assert diff["mean"] == pytest.approx(summary["entries"][entry]["loss"] - summary["entries"]["attn_qat"]["loss"])
        assert diff["ci"][0] <= diff["mean"] <= diff["ci"][1] and set(diff["per_seed"]) == {"0"}
    for key in extra_keys:
        assert key in summary["extras"]
    # On the CPU, the packed prefill / packed attention and the NVFP4 cache compute what the fake-quant forward does,
    # bit for bit.
    for entry, seeds in summary["extras"]["fake_quant_vs_real_nvfp4"].items():
        for values in seeds.values():
            assert values["max_abs_item_loss_difference"] == 0.0, entry
    with open(out / "results.csv", newline="") as f:
        assert [r["entry"] for r in csv.DictReader(f)] == list(entries)
    assert (out / "table.md").read_text().startswith("| entry |")
    config = summary["config"]
    for arm in arms:
        with open(out / "runs" / f"{arm}_seed0.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["step"]) for r in rows] == [1, 2, 3]
        # the schedule the hand-written code gave: the first update already at the warmup's first step
        assert [float(r["lr"]) for r in rows] == [hand_written_lr(k, 3, config["warmup_steps"], config["lr"])
                                                  for k in (1, 2, 3)], arm
    if importlib.util.find_spec("matplotlib"):
        assert all((out / name).exists() for name in ("loss.png", "grad_norm.png", "gaps.png"))
    for arm in ("attn_qat_qk_distill", "attn_qat_qk_distill_frozen"):
        if arm not in arms:
            continue
        # A distilled arm's teacher, in lockstep or fine-tuned first, is the bf16 arm again: on the CPU bit for bit.
        teacher = json.loads((out / "runs" / f"{arm}_seed0.json").read_text())["teacher_loss"]
        assert teacher == json.loads((out / "runs" / "bf16_seed0.json").read_text())["loss"], arm
        assert summary["entries"][arm]["teacher_loss_per_seed"] == {"0": teacher}
        with open(out / "runs" / f"{arm}_seed0.csv", newline="") as f:
            assert all(math.isfinite(float(r["distill_loss"])) for r in csv.DictReader(f))
    if {"attn_qat_qk_distill", "attn_qat_qk_distill_frozen"} <= set(arms):
        # The frozen arm learns from the finished teacher, the lockstep one from a moving one: their objectives differ.
        curves = []
        for arm in ("attn_qat_qk_distill", "attn_qat_qk_distill_frozen"):
            with open(out / "runs" / f"{arm}_seed0.csv", newline="") as f:
                curves.append([float(r["distill_loss"]) for r in csv.DictReader(f)])
        assert curves[0] != curves[1]
    return summary


@pytest.mark.slow
def test_finetune_lm_smoke_cpu(tiny_gguf, tmp_path):
    importorskip("scipy")  # the report's bootstrap
    path, _ = tiny_gguf
    out = tmp_path / "lm"
    run_script(["examples/finetune_lm.py", "--preset", "smoke", "--device", "cpu", "--gguf", str(path),
                "--gguf-sha256", sha256(path), "--out", str(out)])
    summary = check_report(out, ("greedy_agreement_with_bf16", "fake_quant_vs_real_nvfp4"), LM_ARMS, LM_ENTRIES)
    assert "recovered" in summary["entries"]["ptq_qk"]
    for entry, seeds in summary["extras"]["fake_quant_vs_real_nvfp4"].items():
        for values in seeds.values():
            assert values["cache_token_agreement"] == 1.0 and values["cache_max_logit_difference"] == 0.0, entry
    assert summary["config"]["data"]["heldout"]["files"] >= 1
    assert summary["config"]["train_windows"].startswith("without replacement")
    # A second invocation finds every run done and only rewrites the report.
    written = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    run_script(["examples/finetune_lm.py", "--preset", "smoke", "--device", "cpu", "--gguf", str(path),
                "--gguf-sha256", sha256(path), "--out", str(out)])
    assert {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()} == written
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["invocations"]) == 1 and summary["invocations_consistent"]
    assert summary["config"]["data"]["heldout"]["tokens_sha256"]


@pytest.mark.slow
def test_finetune_lm_pareto_smoke_cpu(tiny_gguf, tmp_path):
    """--keep-bf16 / --keep-by (the precision knob's Pareto): the bf16 fine-tune again with its sensitivity map, PTQ
    and attn_qat_qk with K layers kept in bf16 chosen by the map or at random, and the recovered fractions."""
    path, _ = tiny_gguf
    out = tmp_path / "lm_pareto"
    run_script(["examples/finetune_lm.py", "--preset", "smoke", "--device", "cpu", "--gguf", str(path),
                "--gguf-sha256", sha256(path), "--out", str(out), "--arms", "bf16", "--keep-bf16", "0,1,2"])
    pareto = json.loads((out / "pareto.json").read_text())
    entries = pareto["entries"]
    expected = {"ptq_keep0", "attn_qat_qk_keep0"} | {f"{kind}_keep{k}_{by}" for kind in ("ptq", "attn_qat_qk")
                                                     for k in (1, 2) for by in ("sensitivity", "random")}
    assert set(entries) == expected
    assert entries["ptq_keep0"]["recovered"] == 0.0
    layers = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    bf16 = json.loads((out / "runs" / "pareto" / "bf16_seed0.json").read_text())
    ranking = bf16["sensitivity"]["ranking"]
    assert sorted(ranking) == layers and len(bf16["sensitivity"]["single"]) == 2
    for by in ("sensitivity", "random"):
        assert entries[f"ptq_keep1_{by}"]["kept_per_seed"]["0"] == entries[f"attn_qat_qk_keep1_{by}"]["kept_per_seed"][
            "0"]
        assert sorted(entries[f"ptq_keep2_{by}"]["kept_per_seed"]["0"]) == layers
    assert entries["ptq_keep1_sensitivity"]["kept_per_seed"]["0"] == ranking[:1]
    # every layer kept in bf16: PTQ is the bf16 fine-tune itself (exact attention, to the kernels' rounding; the smoke
    # run's PTQ gap is too small for the ratio to say it)
    assert entries["ptq_keep2_sensitivity"]["loss"] == pytest.approx(bf16["loss"], abs=1e-3)
    for name in ("ptq_keep1_sensitivity", "attn_qat_qk_keep2_random"):  # the real NVFP4 path honours the plan too
        payload = json.loads((out / "runs" / "pareto" / f"{name}_seed0.json").read_text())
        assert payload["real_path"]["cache_token_agreement"] == 1.0, name
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["pareto"]["entries"]) == expected
    assert (out / "pareto.md").read_text().count("| `") == len(expected)


@pytest.mark.slow
def test_finetune_wan_pareto_smoke_cpu(tmp_path):
    importorskip("diffusers")
    out = tmp_path / "wan_pareto"
    run_script(["examples/finetune_wan.py", "--preset", "smoke", "--device", "cpu", "--out", str(out),
                "--pretrained", str(tmp_path / "pretrained.pt"), "--arms", "bf16", "--keep-bf16", "0,1",
                "--keep-by", "sensitivity,single"])
    entries = json.loads((out / "pareto.json").read_text())["entries"]
    assert set(entries) == {f"{kind}_{k}" for kind in ("ptq", "attn_qat_qk")
                            for k in ("keep0", "keep1_sensitivity", "keep1_single")}
    sensitivity = json.loads((out / "runs" / "pareto" / "bf16_seed0.json").read_text())["sensitivity"]
    assert sorted(sensitivity["ranking"]) == sorted(sensitivity["ranking_single"]) == ["blocks.0.attn1",
                                                                                        "blocks.1.attn1"]
    assert entries["attn_qat_qk_keep1_sensitivity"]["kept_per_seed"] == {"0": sensitivity["ranking"][:1]}
    assert entries["attn_qat_qk_keep1_single"]["kept_per_seed"] == {"0": sensitivity["ranking_single"][:1]}


def test_pareto_options_are_checked():
    finetune_lm = load_example("finetune_lm")
    with pytest.raises(SystemExit):
        finetune_lm.parse_args(["--keep-bf16", "1,x"])
    with pytest.raises(SystemExit):
        finetune_lm.parse_args(["--keep-bf16", "1", "--keep-by", "largest"])
    assert finetune_lm.parse_args(["--keep-bf16", "1", "--keep-by", "single,random", "--device", "cpu"]).keep_by == [
        "single", "random"]
    args = finetune_lm.parse_args(["--keep-bf16", "3,0,3", "--device", "cpu"])
    assert args.keep_bf16 == [0, 3] and args.keep_by == ["sensitivity", "random"]
    assert finetune_lm.parse_args(["--device", "cpu"]).keep_bf16 == []


@pytest.mark.slow
def test_finetune_wan_smoke_cpu(tmp_path):
    importorskip("diffusers")
    importorskip("scipy")  # the report's bootstrap
    out = tmp_path / "wan"
    run_script(["examples/finetune_wan.py", "--preset", "smoke", "--device", "cpu", "--out", str(out),
                "--pretrained", str(tmp_path / "pretrained.pt")])
    summary = check_report(out, ("sample_psnr_vs_bf16", "sample_psnr_vs_source"), LM_ARMS, LM_ENTRIES)
    assert set(summary["extras"]["sample_psnr_vs_bf16"]) == set(LM_ENTRIES) - {"bf16"}
    assert summary["config"]["pretrain_result"]["weights_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("script, library", [("finetune_lm.py", "transformers"), ("finetune_wan.py", "diffusers")])
def test_help_without_the_libraries(script, library):
    from test_examples import HIDDEN_IMPORTS
    result = subprocess.run([sys.executable, "-c", HIDDEN_IMPORTS, f"examples/{script}"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " ".join(result.stdout.split()).startswith("usage: ") and library in result.stdout


def test_split_and_join(tmp_path):
    source = tmp_path / "model.bin"
    source.write_bytes(torch.randint(0, 256, (3 * 1024 * 1024 + 17,), dtype=torch.uint8).numpy().tobytes())
    parts = tmp_path / "parts"
    subprocess.run(["bash", "dev/split_file.sh", str(source), str(parts), "1"], cwd=REPO, check=True,
                   capture_output=True)
    names = sorted(p.name for p in parts.iterdir())
    assert names == ["model.bin.part00", "model.bin.part01", "model.bin.part02", "model.bin.part03", "model.bin.sha256"]
    assert all((parts / n).stat().st_size <= 1024 * 1024 for n in names[:-1])
    joined = tmp_path / "joined.bin"
    digest = sha256(source)
    result = subprocess.run(["bash", "dev/join_file.sh", str(joined), digest, *sorted(map(str, parts.glob("*.part*")))],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert joined.read_bytes() == source.read_bytes()
    # A missing part is caught by the checksum, and nothing is left behind.
    bad = tmp_path / "bad.bin"
    result = subprocess.run(["bash", "dev/join_file.sh", str(bad), digest, str(parts / "model.bin.part00")], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "SHA-256" in result.stderr and not bad.exists()


def test_master_weights_keep_small_updates():
    """bf16 weights with fp32 master copies: steps too small for a bf16 weight's last bit still add up."""
    common = load_example("finetune_common")
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizer = common.MasterWeightAdamW([weight], lr=1e-4)
    for _ in range(30):  # Adam moves each step by ~lr; 1e-4 is far below half of bf16's spacing under 1.0 (2^-9)
        weight.grad = torch.ones_like(weight)
        norm = optimizer.step()
    assert float(norm) == pytest.approx(2.0)
    assert optimizer.master[0].dtype == torch.float32 and torch.allclose(optimizer.master[0], torch.full((4,), 0.997),
                                                                         atol=1e-4)
    assert torch.equal(weight, torch.full((4,), 0.99609375, dtype=torch.bfloat16))  # the master, rounded to bf16
    assert weight.grad is None


@pytest.mark.parametrize("example", ["finetune_lm", "finetune_wan"])
def test_balance_qk_is_checked_when_parsed(example):
    module = load_example(example)
    for bad in ("0", "1.5", "nan"):
        with pytest.raises(SystemExit):
            module.parse_args(["--device", "cpu", "--balance-qk", bad])
    assert module.parse_args(["--device", "cpu", "--balance-qk", "0.3"]).balance_qk == 0.3
