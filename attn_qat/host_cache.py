"""Values read from device tensors to the host once and reused while the tensor is unchanged (a model's layers pass
the same cu_seqlens, position_ids, masks and buffers one after another): cached by the tensor and its version."""
from typing import Callable, Hashable, Optional, TypeVar

import torch
from torch.utils.weak import WeakTensorKeyDictionary

T = TypeVar("T")


def version_of(tensor):
    """`tensor`'s version counter, or a new object for an inference tensor, which has none (so never a cache hit)."""
    return object() if tensor.is_inference() else tensor._version


class HostCache:
    """Per tensor (held weakly): the value `compute()` gave for its current version and `key`."""

    def __init__(self):
        self._values = WeakTensorKeyDictionary()

    def get(self, tensor: torch.Tensor, compute: Callable[[], T], key: Optional[Hashable] = None) -> T:
        stamp = (version_of(tensor), key)
        cached = self._values.get(tensor)
        if cached is None or cached[0] != stamp:
            cached = (stamp, compute())
            self._values[tensor] = cached
        return cached[1]
