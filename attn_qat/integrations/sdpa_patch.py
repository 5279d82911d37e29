"""`patch_sdpa`: route `torch.nn.functional.scaled_dot_product_attention` to attn_qat inside a context."""
import contextlib
import dataclasses
import functools
from typing import Optional

import torch

from .config import QATConfig, run_sdpa


class patch_sdpa(contextlib.ContextDecorator):
    """Context manager (or decorator) that makes `torch.nn.functional.scaled_dot_product_attention` run
    attn_qat for the calls it supports and PyTorch's own SDPA for the rest.

        with attn_qat.patch_sdpa(attn_qat.QATConfig(mode="attn_qat")):
            loss = model(x).sum()      # every F.scaled_dot_product_attention call inside is 4-bit
        loss.backward()                # the backward needs no patch

    Keyword arguments override fields of `config` (`patch_sdpa(strict=True)`). A call attn_qat does not
    take (head_dim not 64/128, float32 outside autocast, dropout_p > 0, a mask that requires grad, 5-D
    inputs, ...) runs the original SDPA and warns once per distinct reason per context with an
    `AttnQATFallbackWarning`; with `strict=True` it raises `NotImplementedError` instead.

    Scope: the patch replaces the attribute of the `torch.nn.functional` module, so it reaches every
    caller that looks the function up at call time (`F.scaled_dot_product_attention(...)`, as
    transformers' "sdpa" and diffusers' "native" attention do), but not code that bound the function
    earlier (`from torch.nn.functional import scaled_dot_product_attention` at import time). It is
    process-wide while active: enter and leave it on one thread. Contexts nest; each restores what it
    found on entry, so they must exit in reverse order of entry, as `with` blocks do (an out-of-order exit
    restores the unpatched function and raises `RuntimeError`). Under torch.compile the function is
    looked up while tracing and dynamo guards on it: a compiled function called inside and outside the
    context gets one graph for each (a recompile, not a wrong result).
    """

    def __init__(self, config: Optional[QATConfig] = None, **overrides):
        config = config if config is not None else QATConfig()
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self._previous = None
        self._patched = None

    def __enter__(self):
        if self._patched is not None:
            raise RuntimeError("attn_qat.patch_sdpa: this context is already active; create a new one to nest")
        previous = torch.nn.functional.scaled_dot_product_attention
        # An enclosing patch's wrapper records what it replaced: fall back to that, never to attn_qat.
        fallback = getattr(previous, "_attn_qat_fallback", previous)
        config, warned = self.config, set()

        @functools.wraps(fallback)
        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False):
            return run_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, config=config,
                            warned=warned, where="attn_qat.patch_sdpa")

        scaled_dot_product_attention._attn_qat_fallback = fallback
        self._previous, self._patched = previous, scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
        return self

    def __exit__(self, exc_type, exc, tb):
        patched, previous = self._patched, self._previous
        self._previous = self._patched = None
        if torch.nn.functional.scaled_dot_product_attention is patched:
            torch.nn.functional.scaled_dot_product_attention = previous
            return False
        # Exited out of order (or someone replaced the function inside): put back the function underneath
        # every attn_qat patch, so that no stale wrapper survives, and say so.
        torch.nn.functional.scaled_dot_product_attention = patched._attn_qat_fallback
        if exc_type is None:
            raise RuntimeError("attn_qat.patch_sdpa: torch.nn.functional.scaled_dot_product_attention changed inside "
                               "the context (nested contexts exited out of order?); restored the unpatched function")
        return False
