"""One home for the input rules (attn_qat.attention.input_problem): for every input attn_qat does not take, the
public functions raise the problem's exception, and the integrations fall back (or raise under strict) naming the
same reason (unsupported_reason)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import attn_qat
from attn_qat import AttnQATFallbackWarning, QATConfig, patch_sdpa
from attn_qat.attention import Problem, input_problem, unsupported_reason
from attn_qat.integrations import routing as integration_routing


def _x(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


def _case(name):
    """(args, kwargs, expected exception type, words of the reason) of a call attn_qat does not take."""
    q = _x(1, 4, 20, 64)
    if name == "dropout":
        return (q, q, q), {"dropout_p": 0.1}, ValueError, "dropout_p > 0"
    if name == "mask_and_causal":
        return (q, q, q), {"attn_mask": torch.ones(20, 20, dtype=torch.bool), "is_causal": True}, ValueError, "both"
    if name == "not_a_tensor":
        return (q, q, q.tolist()), {}, TypeError, "must all be tensors"
    if name == "mixed_dims":
        return (q[0], q, q), {}, ValueError, "different numbers of dimensions"
    if name == "five_dims":
        return (q[None], q[None], q[None]), {}, ValueError, "5-D inputs"
    if name == "devices":
        return (q, q.to("meta"), q), {}, ValueError, "one device"
    if name == "dtypes":
        return (q, q.half(), q), {}, TypeError, "different dtypes"
    if name == "float64":
        return (q.double(), q.double(), q.double()), {}, TypeError, "dtype torch.float64"
    if name == "head_dim":
        x = _x(1, 2, 20, 72)
        return (x, x, x), {}, ValueError, "head_dim 72"
    if name == "shared_head_dim":
        return (q, q[..., :32].contiguous(), q), {}, ValueError, "share head_dim"
    if name == "batch":
        return (q, _x(2, 4, 20, 64), _x(2, 4, 20, 64)), {}, ValueError, "batch sizes differ"
    if name == "kv_tokens":
        return (q, q, _x(1, 4, 21, 64)), {}, ValueError, "same heads and tokens"
    if name == "heads_ratio":
        return (q, _x(1, 3, 20, 64), _x(1, 3, 20, 64)), {"enable_gqa": True}, ValueError, "multiple"
    if name == "gqa_flag":
        return (q, q[:, :2], q[:, :2]), {}, ValueError, "enable_gqa=True"
    if name == "mask_type":
        return (q, q, q), {"attn_mask": [[True]]}, TypeError, "attn_mask is not a tensor"
    if name == "mask_grad":
        mask = torch.zeros(20, 20, dtype=torch.bfloat16, requires_grad=True)
        return (q, q, q), {"attn_mask": mask}, NotImplementedError, "requires grad"
    if name == "mask_dtype":
        return (q, q, q), {"attn_mask": torch.ones(20, 20, dtype=torch.int64)}, TypeError, "bool or floating point"
    if name == "mask_shape":
        return (q, q, q), {"attn_mask": torch.ones(3, 20, dtype=torch.bool)}, ValueError, "broadcast"
    raise AssertionError(name)


CASES = ["dropout", "mask_and_causal", "not_a_tensor", "mixed_dims", "five_dims", "devices", "dtypes", "float64",
         "head_dim", "shared_head_dim", "batch", "kv_tokens", "heads_ratio", "gqa_flag", "mask_type",
         "mask_grad", "mask_dtype", "mask_shape"]
# calls torch's own SDPA refuses as well: a fallback would raise torch's error, so only the strict path is compared
TORCH_REFUSES = {"mask_and_causal", "not_a_tensor", "devices", "dtypes", "shared_head_dim", "heads_ratio", "gqa_flag",
                 "mask_type", "mask_dtype", "mask_shape"}


@pytest.mark.parametrize("name", CASES)
def test_public_function_raises_the_reason(name):
    args, kwargs, error, words = _case(name)
    problem = input_problem(*args, **kwargs)
    assert isinstance(problem, Problem) and words in problem.reason and problem.error is error
    assert unsupported_reason(*args, **kwargs) == problem.reason
    with pytest.raises(error) as raised:
        attn_qat.scaled_dot_product_attention(*args, **kwargs)
    assert str(raised.value) == f"attn_qat.scaled_dot_product_attention: {problem.reason}{problem.details}"


def _run_sdpa(args, kwargs, **config):
    """The integrations' common path (patch_sdpa, transformers, diffusers): torch's SDPA arguments in order."""
    bound = dict(zip(("query", "key", "value"), args), **kwargs)
    return integration_routing.run_sdpa(
        bound["query"], bound["key"], bound["value"], bound.get("attn_mask"), bound.get("dropout_p", 0.0),
        bound.get("is_causal", False), None, bound.get("enable_gqa", False), config=QATConfig(**config), warned=set(),
        where="attn_qat (test)")


@pytest.mark.parametrize("name", CASES)
def test_integrations_fall_back_on_the_same_reason(name):
    args, kwargs, _, _ = _case(name)
    reason = unsupported_reason(*args, **kwargs)
    assert integration_routing.unsupported_reason is unsupported_reason
    with pytest.raises(NotImplementedError) as raised:
        _run_sdpa(args, kwargs, strict=True)
    assert str(raised.value) == f"attn_qat (test): {reason} (strict=True forbids falling back to PyTorch SDPA)"
    if name not in TORCH_REFUSES:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            _run_sdpa(args, kwargs)
        messages = [str(w.message) for w in record if issubclass(w.category, AttnQATFallbackWarning)]
        assert messages == [f"attn_qat: falling back to PyTorch scaled_dot_product_attention: {reason}"]
    if name not in ("not_a_tensor", "mask_type"):  # torch's argument parser refuses a list before any mode sees it
        with patch_sdpa(strict=True), pytest.raises(NotImplementedError) as raised:
            F.scaled_dot_product_attention(*args, **kwargs)
        assert str(raised.value).startswith(f"attn_qat.patch_sdpa: {reason} (strict=True")


def test_flash_style_entry_point_uses_the_same_rules():
    q = _x(1, 20, 4, 72)
    problem = input_problem(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), ndims=(4,))
    with pytest.raises(ValueError) as raised:
        attn_qat.attention(q, q, q)
    assert str(raised.value) == f"attn_qat.attention: {problem.reason}{problem.details}"
    # grouped KV heads need no flag there
    q, kv = _x(1, 20, 4, 64), _x(1, 20, 2, 64)
    assert attn_qat.attention(q, kv, kv).shape == q.shape
    x = _x(4, 20, 64)
    assert unsupported_reason(x, x, x, ndims=(4,)) == "3-D inputs are not supported (4-D only)"


def test_supported_calls_have_no_reason():
    q = _x(2, 4, 20, 64)
    assert unsupported_reason(q, q, q) is None
    assert unsupported_reason(q[0], q[0], q[0], attn_mask=torch.ones(1, 4, 20, 20, dtype=torch.bool)) is None
    assert unsupported_reason(q, q[:, :2], q[:, :2], enable_gqa=True, attn_mask=torch.zeros(20, 20)) is None
    meta = q.to("meta")  # attn_qat's fake kernels compute shapes on the meta device
    assert unsupported_reason(meta, meta, meta) is None
    assert attn_qat.scaled_dot_product_attention(meta, meta, meta).shape == q.shape
