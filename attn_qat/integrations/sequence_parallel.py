"""Ulysses sequence parallelism (DeepSpeed-Ulysses, arXiv 2309.14509) for attn_qat.

Each of the P ranks of a process group holds a slice of the sequence, (B, S/P, H, D). An all-to-all over the
heads gives every rank the whole sequence for H/P heads, attention runs there as in one process, and a second
all-to-all gives each rank its slice of the sequence back, for all heads. Each head sees exactly the tokens it
sees in one process, so attn_qat's numerics (V blocked along the whole sequence, P's 16-key blocks counted from
key 0, the per-row softmax frame) are those of the unsharded call; ring attention over chunks of keys
(`merge_attention_states`) only approximates them.

- `ulysses_attention(q, k, v, group)`: `attn_qat.attention` on a sequence sharded over `group`.
- `ulysses_wan(model, group)`: runs a diffusers Wan transformer (`WanTransformer3DModel`) with its video tokens
  sharded over `group` and its self-attention through the all-to-all; `all_reduce_gradients` then sums the
  parameter gradients over the group.

The attention of a module under `ulysses_wan` goes through the all-to-all inside `run_sdpa` (routing.py), the one
routine through which every integration calls attn_qat: the module's forward hooks mark the call (a per-thread
flag, `current`), and `run_sdpa` hands a marked call to `UlyssesCall.sdpa`. The processor itself is not changed.
See docs/integrations.md, "Sequence parallel (Ulysses)".
"""
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..attention import attention


# --- the all-to-all ----------------------------------------------------------------------------------------------

def _group_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("attn_qat sequence parallelism: a process group was given but torch.distributed is "
                               "not initialized")
        return 1
    return dist.get_world_size(group)


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Splits x into P equal parts along scatter_dim, sends part p to rank p, and concatenates the parts received
    along gather_dim in rank order."""
    p = dist.get_world_size(group)
    send = x.unflatten(scatter_dim, (p, x.shape[scatter_dim] // p)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[r]: rank r's part, shaped like send[r]; rank order becomes the major index of gather_dim
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` under autograd: its adjoint is the all-to-all with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S/P, H, D) on each rank -> (B, S, H/P, D): the whole sequence, this rank's heads."""
    return _AllToAll.apply(x, group, 2, 1)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S, H/P, D) -> (B, S/P, H, D): this rank's tokens, all heads."""
    return _AllToAll.apply(x, group, 1, 2)


def _kv_heads(heads: int, kv_heads: int, p: int, fn: str) -> int:
    """How often each KV head is repeated before the all-to-all: 1 when the KV heads divide among the ranks, P /
    H_kv when fewer KV heads than ranks (each rank then receives the one KV head its query heads use)."""
    if heads % p:
        raise ValueError(f"attn_qat.{fn}: the {heads} query heads do not divide among {p} ranks (Ulysses gives each "
                         "rank H/P whole heads)")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"attn_qat.{fn}: query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if kv_heads % p == 0:
        return 1
    if p % kv_heads == 0:
        return p // kv_heads
    raise ValueError(f"attn_qat.{fn}: {kv_heads} key/value heads can be neither split among nor replicated over {p} "
                     "ranks (need H_kv % P == 0 or P % H_kv == 0)")


def _ulysses(fn: Callable, q, k, v, group, name: str, lse: bool = False):
    """fn(q, k, v) on (B, S, H/P, D) after the all-to-all; its output (and with `lse` its (B, H/P, S) log-sum-exp)
    back to this rank's tokens."""
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"attn_qat.{name}: {label} must be a 4-D (batch, tokens, heads, head_dim) tensor")
    p = _group_size(group)
    if p == 1:
        return fn(q, k, v)
    repeat = _kv_heads(q.shape[2], k.shape[2], p, name)
    if repeat > 1:
        # Hkv < P: rank r's query heads all use KV head r // repeat, so each KV head goes to `repeat` ranks. The
        # gradient of repeat_interleave sums the ranks' dK, dV (each over its own query heads).
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    result = fn(_seq_to_heads(q, group), _seq_to_heads(k, group), _seq_to_heads(v, group))
    if not lse:
        return _heads_to_seq(result, group)
    out, row_lse = result
    # (B, H/P, S) -> (B, S, H/P, 1) -> (B, S/P, H, 1) -> (B, H, S/P); the LSE carries no gradient
    row_lse = _heads_to_seq(row_lse.transpose(1, 2).unsqueeze(-1).contiguous(), group).squeeze(-1).transpose(1, 2)
    return _heads_to_seq(out, group), row_lse


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                      **attention_kwargs):
    """`attn_qat.attention` over a sequence sharded among the ranks of `group` (default: the world).

    q (B, S/P, H, D), k and v (B, S_kv/P, H_kv, D): this rank's slice of the tokens (rank r holds tokens
    r*S/P .. (r+1)*S/P - 1), the same shape on every rank. Returns this rank's slice of the output of attention
    over the whole sequence, (B, S/P, H, D), and with `return_lse=True` its (B, H, S/P) log-sum-exp.
    `attention_kwargs` are `attn_qat.attention`'s (causal, softmax_scale, mode, return_lse, v_block_axis;
    `layout`, if given, must be "bshd"). Differentiable: the all-to-alls' backward is the reverse all-to-all.

    Heads: H % P == 0. Grouped KV heads are split among the ranks when H_kv % P == 0, and replicated when
    P % H_kv == 0 (each rank receives the KV head its H/P query heads use); anything else raises ValueError.
    Each head sees the whole sequence, so output, LSE and dQ equal one process's `attention` on the full
    sequence exactly (the same kernel on the same per-head inputs; on the GPU with
    `attn_qat.ops.kernel_options(tail_split=0)` and deterministic algorithms, else to the last bits of fp32 sums); dK and dV too, except with replicated KV heads,
    where each rank's dK, dV over its query heads are rounded to the input dtype before they are summed.
    Without torch.distributed (or with one rank) this is `attention`.
    """
    layout = attention_kwargs.pop("layout", "bshd")
    if layout != "bshd":
        raise ValueError(f"attn_qat.ulysses_attention: layout must be 'bshd' (tokens before heads), got {layout!r}")
    return _ulysses(lambda q_, k_, v_: attention(q_, k_, v_, layout="bshd", **attention_kwargs), q, k, v, group,
                    "ulysses_attention", lse=attention_kwargs.get("return_lse", False))


# --- the flag that run_sdpa consults -----------------------------------------------------------------------------

_local = threading.local()


class UlyssesCall:
    """One forward of an attention module under sequence parallelism: while it runs, `current()` returns it, and
    `run_sdpa` routes the module's attention through `sdpa`. `count` tells the module's forward hook whether the
    attention really went through the all-to-all (a processor that bypasses `run_sdpa`, e.g. the module's original
    one after `attn_qat.disable`, would attend over this rank's tokens only)."""

    def __init__(self, group):
        self.group = group
        self.count = 0

    def sdpa(self, run_sdpa: Callable, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
             **kwargs):
        """`run_sdpa` (SDPA conventions: (B, H, S/P, D), top-left causal) over the whole sequence: the all-to-all,
        `run_sdpa` on (B, H/P, S, D) views with the flag cleared, the all-to-all back."""
        if attn_mask is not None:
            raise NotImplementedError("attn_qat sequence parallelism: attention masks are not supported (a mask "
                                      "over this rank's queries and all keys is not redistributed)")
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
            raise ValueError("attn_qat sequence parallelism: query, key and value must be 4-D (B, H, S, D)")
        self.count += 1
        previous = getattr(_local, "call", None)
        _local.call = None
        try:
            def run(q, k, v):
                out = run_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, dropout_p, is_causal,
                               scale, enable_gqa, **kwargs)
                return out.transpose(1, 2)
            return _ulysses(run, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), self.group,
                            "sequence parallelism").transpose(1, 2)
        finally:
            _local.call = previous


def current() -> Optional[UlyssesCall]:
    """The sequence-parallel attention call running on this thread, or None."""
    return getattr(_local, "call", None)


# --- Wan ---------------------------------------------------------------------------------------------------------

class _GatherTokens(torch.autograd.Function):
    """All-gather along the tokens (dim 1). Every rank computes the same thing from the gathered tensor (the loss
    on the whole output), so the gradient of this rank's slice is the slice of the gradient: no reduction."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        p, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        n = grad.shape[1] // p
        return grad.narrow(1, r * n, n), None


def _shard(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[dim] // p
    return x.narrow(dim, r * n, n)


class ulysses_wan:  # noqa: N801 (used like a function or as a context manager)
    """Runs a diffusers Wan transformer (`WanTransformer3DModel`) with its video tokens sharded over `group`.

        model = attn_qat.prepare(WanTransformer3DModel(...), QATConfig(...))   # every rank: the same model
        with attn_qat.ulysses_wan(model, group):
            loss = F.mse_loss(model(latents, t, text).sample, target)          # the same full inputs on every rank
        loss.backward()
        attn_qat.all_reduce_gradients(model, group)                             # sum over the group

    Forward hooks (the processor is not touched): after patchifying, block 0 gets this rank's P-th of the video
    tokens, and the rotary table (and a per-token timestep, Wan 2.2 TI2V) is sliced alike; the output projection
    gathers the tokens back, so every rank gets the whole output and computes the same loss. In between, every
    per-token layer runs on this rank's tokens, the text cross-attention attends from them to all text tokens,
    and the self-attention of each `WanAttention` module goes through the all-to-all (`UlyssesCall`).

    Requirements: the self-attention modules run attn_qat (`attn_qat.prepare`, not disabled; a module whose
    attention bypasses attn_qat raises RuntimeError rather than attending over one rank's tokens); the number of
    video tokens and the heads divide by P (ValueError). Each rank's parameter gradients then cover its tokens:
    `all_reduce_gradients` sums them (not averages: the loss is not split among ranks). With gradient
    checkpointing the backward recomputes blocks, so it must run while the hooks are installed (inside the `with`,
    or between `ulysses_wan(...)` and `.remove()`). Not combined with data parallelism here.
    """

    def __init__(self, model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None):
        from diffusers.models.transformers.transformer_wan import WanAttention

        model = getattr(model, "module", model)  # DDP / FSDP wrappers
        for name in ("rope", "blocks", "proj_out", "config"):
            if not hasattr(model, name):
                raise TypeError(f"attn_qat.ulysses_wan: {type(model).__name__} has no {name!r}; expected a diffusers "
                                "WanTransformer3DModel")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("attn_qat.ulysses_wan: torch.distributed is not initialized")
        self.group, self.model = group, model
        self.size = dist.get_world_size(group)
        heads = model.config.num_attention_heads
        if heads % self.size:
            raise ValueError(f"attn_qat.ulysses_wan: the model's {heads} heads do not divide among {self.size} ranks")
        attention_modules = [m for m in model.modules() if isinstance(m, WanAttention) and not m.is_cross_attention]
        hooks = [
            model.register_forward_pre_hook(self._model_inputs, with_kwargs=True),
            model.rope.register_forward_hook(self._rope),
            model.blocks[0].register_forward_pre_hook(self._block_inputs, with_kwargs=True),
            model.proj_out.register_forward_hook(self._gather),
        ]
        for module in attention_modules:
            hooks.append(module.register_forward_pre_hook(self._attention_start))
            hooks.append(module.register_forward_hook(self._attention_end))
        self._hooks = hooks

    # hooks
    def _model_inputs(self, module, args, kwargs):
        _local.call = None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        patch = module.config.patch_size
        tokens = (hidden.shape[2] // patch[0]) * (hidden.shape[3] // patch[1]) * (hidden.shape[4] // patch[2])
        if tokens % self.size:
            raise ValueError(f"attn_qat.ulysses_wan: {tokens} video tokens do not divide among {self.size} ranks")
        timestep = kwargs["timestep"] if "timestep" in kwargs else args[1] if len(args) > 1 else None
        if timestep is not None and timestep.dim() == 2:  # one timestep per token (Wan 2.2 TI2V)
            timestep = _shard(timestep, self.group)
            if "timestep" in kwargs:
                kwargs["timestep"] = timestep
            else:
                args = (args[0], timestep, *args[2:])
            return args, kwargs
        return None

    def _rope(self, module, args, output):
        return tuple(_shard(t, self.group) for t in output)

    def _block_inputs(self, module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = _shard(kwargs["hidden_states"], self.group)
        else:
            args = (_shard(args[0], self.group), *args[1:])
        return args, kwargs

    def _gather(self, module, args, output):
        return _GatherTokens.apply(output, self.group)

    # Self-attention modules do not nest, so the flag is set and cleared, not stacked; the model's pre-hook clears
    # it too, so that a forward that raised half-way (an out-of-memory error, say) leaves nothing behind.
    def _attention_start(self, module, args):
        _local.call = UlyssesCall(self.group)

    def _attention_end(self, module, args, output):
        call, _local.call = getattr(_local, "call", None), None
        if call is None or call.count == 0:
            raise RuntimeError("attn_qat.ulysses_wan: a self-attention module ran without attn_qat (not prepared, or "
                               "disabled), so it would attend over this rank's tokens only")

    def remove(self) -> None:
        """Removes the hooks: the model runs unsharded again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        _local.call = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def all_reduce_gradients(module: torch.nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Sums the parameter gradients of `module` over `group`, in one all-reduce per dtype. Under sequence
    parallelism each rank's gradients cover its tokens and every rank's loss is the whole loss, so the sum, not the
    mean that DDP takes, is the full gradient."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
