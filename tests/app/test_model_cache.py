"""app_pages.caching.built_by_loaded_code: the cache validator of the pages' models."""
import sys
import types

from app_pages.caching import built_by_loaded_code
from kda_core.config import PRESETS
from kda_core.model import HybridLM


def test_built_by_loaded_code(monkeypatch):
    """A model cached across a Streamlit source reload (its module re-imported, so its class replaced)
    must read as stale: it would hand old-class KDACache objects to the new code (AttributeError)."""
    model = HybridLM(PRESETS["demo-tiny"])
    assert built_by_loaded_code(model)
    reloaded = types.ModuleType(type(model).__module__)
    reloaded.HybridLM = type("HybridLM", (), {})                 # the re-imported module's new class
    monkeypatch.setitem(sys.modules, type(model).__module__, reloaded)
    assert not built_by_loaded_code(model)
    monkeypatch.delitem(sys.modules, type(model).__module__)
    assert not built_by_loaded_code(model)
