"""What the pages' ``st.cache_*`` calls take and keep.

- ``built_by_loaded_code(obj)``: the ``validate=`` of ``st.cache_resource`` for cached models: False
  once a source reload replaced the object's class, so Streamlit rebuilds it.
- ``upload_parts(upload)``: ``(bytes, file name)`` of an ``st.file_uploader`` value, hashable for ``st.cache_data``.
"""
from __future__ import annotations

import sys


def built_by_loaded_code(obj: object) -> bool:
    """True if ``obj``'s class is still the one its module defines (looked up in ``sys.modules`` now).

    For ``st.cache_resource(validate=...)`` on the pages' models: when a source file changes, Streamlit
    evicts and re-imports every project module, but a cached model keeps running the old modules and
    returns caches of the old ``KDACache`` class, which the new code's ``isinstance`` checks reject
    (``AttributeError: 'KDACache' object has no attribute 'shape'``). False makes Streamlit rebuild it."""
    cls = type(obj)
    return getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls


def upload_parts(upload) -> tuple[bytes | None, str]:
    """``(content bytes, file name)`` of an uploaded file (anything with ``getvalue()`` and ``name``,
    e.g. a Streamlit ``UploadedFile``), or ``(None, "")`` without one. An empty file gives ``b""``,
    not None, so the loaders can report it instead of silently falling back to a default trace."""
    if upload is None:
        return None, ""
    return upload.getvalue(), str(getattr(upload, "name", "") or "uploaded file")
