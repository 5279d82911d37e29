"""`patch_sdpa`: route `torch.nn.functional.scaled_dot_product_attention` to attn_qat inside a context, as a
`torch.overrides.TorchFunctionMode` on the current thread."""
import contextlib
import dataclasses
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .config import QATConfig
from .routing import passing_through, run_sdpa

# The function every spelling of SDPA is: torch.nn.functional's attribute, a name imported from it, torch._C._nn's.
_SDPA = torch._C._nn.scaled_dot_product_attention


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's arguments, positional or keyword, in order."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class patch_sdpa(TorchFunctionMode, contextlib.ContextDecorator):
    """Context manager (or decorator) that makes `torch.nn.functional.scaled_dot_product_attention` run
    attn_qat for the calls it supports and PyTorch's own SDPA for the rest.

        with attn_qat.patch_sdpa(attn_qat.QATConfig(mode="attn_qat")):
            loss = model(x).sum()      # every F.scaled_dot_product_attention call inside is 4-bit
        loss.backward()                # the backward needs no patch

    Keyword arguments override fields of `config` (`patch_sdpa(strict=True)`). A call attn_qat does not
    take (a head dim not a multiple of 16 from 32 to 256, float64, dropout_p > 0, a mask that requires grad, 5-D
    inputs, ...) runs the original SDPA and warns once per distinct reason per context with an
    `AttnQATFallbackWarning`; with `strict=True` it raises `NotImplementedError` instead.

    Scope: a torch function mode, so it intercepts the SDPA function itself, however the caller reached it
    (`F.scaled_dot_product_attention(...)`, a name imported with `from torch.nn.functional import
    scaled_dot_product_attention` before the context, `torch._C._nn.scaled_dot_product_attention`), and only
    on the thread that entered the context (torch keeps a mode stack per thread): other threads run what they
    ran. Every other torch function called inside passes through it unchanged (one Python call each).
    Contexts nest, innermost first; a fallback runs PyTorch's SDPA past every attn_qat context (other modes
    still see it). They must exit in reverse order of entry, as `with` blocks do, also on exceptions; an
    out-of-order exit removes every attn_qat context from the thread's mode stack and raises `RuntimeError`.
    As a decorator, each call of the function enters a fresh context (its own warnings; recursion and threads
    are fine). Under torch.compile, dynamo traces the mode of a compiled function called inside the context
    (the same compiled function outside gets a graph of its own); entering the context inside the compiled
    function is not supported (enter it around the call).
    """

    def __init__(self, config: Optional[QATConfig] = None, **overrides):
        super().__init__()
        config = config if config is not None else QATConfig()
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self.config.refuse_qk_transforms("attn_qat.patch_sdpa")
        self.config.refuse_bf16_modules("attn_qat.patch_sdpa")
        self._warned = set()
        self._entered = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs if kwargs is not None else {}
        if func is not _SDPA or passing_through():
            return func(*args, **kwargs)
        return run_sdpa(*_sdpa_arguments(*args, **kwargs), config=self.config, warned=self._warned,
                        where="attn_qat.patch_sdpa")

    def _recreate_cm(self):
        # as a decorator, each call gets its own context (ContextDecorator would reuse this one)
        return patch_sdpa(self.config)

    def __enter__(self):
        if self._entered:
            raise RuntimeError("attn_qat.patch_sdpa: this context is already active; create a new one to nest")
        self._entered, self._warned = True, set()
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        self._entered = False
        stack = _get_current_function_mode_stack()
        if stack and stack[-1] is self:
            return super().__exit__(exc_type, exc, tb)
        # Exited out of order (or on another thread): take every attn_qat context off this thread's mode stack,
        # keeping the other modes in their order, so that no stale one survives, and say so.
        while _get_current_function_mode_stack():
            torch._C._pop_torch_function_stack()
        for mode in stack:
            if not isinstance(mode, patch_sdpa):
                torch._C._push_on_torch_function_stack(mode)
        if exc_type is None:
            raise RuntimeError("attn_qat.patch_sdpa: contexts exited out of order (or on another thread than they "
                               "were entered on); removed every attn_qat.patch_sdpa context of this thread")
        return False
