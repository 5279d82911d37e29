"""Values read from device tensors to the host once and reused while the tensor is unchanged (a model's layers pass
the same cu_seqlens, position_ids, masks and buffers one after another): cached by the tensor and its version."""


def version_of(tensor):
    """`tensor`'s version counter, or a new object for an inference tensor, which has none (so never a cache hit)."""
    return object() if tensor.is_inference() else tensor._version
