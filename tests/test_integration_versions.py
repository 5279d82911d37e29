"""The integrations' version floors (integrations/config.py, pyproject's `integrations` extra): below them, using an
integration raises an ImportError that names the floor, instead of failing somewhere inside the library."""
import sys

import pytest

import attn_qat
from attn_qat.integrations.config import require_version
from conftest import importorskip


def test_require_version_parses_releases(monkeypatch):
    torch = sys.modules["torch"]
    for version, ok in (("4.56.0", True), ("4.57.0.dev0", True), ("5.0.0rc1", True), ("4.55.4", False),
                        ("unknown", False)):
        monkeypatch.setattr(torch, "__version__", version)
        if ok:
            require_version("torch", (4, 56), "this")
        else:
            with pytest.raises(ImportError, match=r"this needs torch >= 4\.56, found .*pip install -U 'torch>=4\.56'"):
                require_version("torch", (4, 56), "this")


def test_transformers_below_the_floor(monkeypatch):
    transformers = importorskip("transformers")
    monkeypatch.setattr(transformers, "__version__", "4.53.3")
    with pytest.raises(ImportError, match=r"transformers >= 4\.54, found 4\.53\.3"):
        attn_qat.register_transformers()
    monkeypatch.setattr(transformers, "__version__", "4.55.0")
    attn_qat.register_transformers()  # the attention implementation works with 4.54 and 4.55 ...
    monkeypatch.delitem(sys.modules, "attn_qat.integrations.kv_cache_transformers", raising=False)
    with pytest.raises(ImportError, match=r"NVFP4Cache needs transformers >= 4\.56, found 4\.55\.0"):
        attn_qat.NVFP4Cache  # ... NVFP4Cache needs 4.56's cache layers


def test_diffusers_below_the_floor(monkeypatch):
    diffusers = importorskip("diffusers")
    monkeypatch.setattr(diffusers, "__version__", "0.34.0")
    with pytest.raises(ImportError, match=r"diffusers >= 0\.35, found 0\.34\.0"):
        attn_qat.register_diffusers_backend()
    with pytest.raises(ImportError, match=r"diffusers >= 0\.35"):
        attn_qat.prepare(diffusers.WanTransformer3DModel(num_attention_heads=1, attention_head_dim=64, in_channels=4,
                                                         out_channels=4, text_dim=8, freq_dim=8, ffn_dim=8,
                                                         num_layers=1))


def test_nvfp4_cache_imports_under_transformers_4(monkeypatch):
    """transformers 4.x calls the config class PretrainedConfig; 5.x PreTrainedConfig."""
    configuration_utils = importorskip("transformers.configuration_utils")
    try:
        require_version("transformers", (4, 56), "NVFP4Cache")
    except ImportError as e:
        pytest.skip(str(e))
    if hasattr(configuration_utils, "PreTrainedConfig"):
        monkeypatch.delattr(configuration_utils, "PreTrainedConfig")
        monkeypatch.setattr(configuration_utils, "PretrainedConfig", object, raising=False)
    monkeypatch.delitem(sys.modules, "attn_qat.integrations.kv_cache_transformers", raising=False)
    assert attn_qat.NVFP4Cache.__name__ == "NVFP4Cache"
