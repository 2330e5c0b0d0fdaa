"""Narrow workarounds for dependency bugs on current versions.

Each patch says which versions it is for and why, so it can be deleted when
the dependency is fixed. ``apply_all()`` is idempotent and cheap.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os

_APPLIED: set[str] = set()


def _once(name: str) -> bool:
    if name in _APPLIED:
        return False
    _APPLIED.add(name)
    return True


def patch_mmengine_package_lookup() -> None:
    """mmengine 0.10.x: absolute imports inside ``read_base()`` call
    ``is_installed``/``get_installed_path``, which import ``pkg_resources``;
    setuptools >= 81 no longer ships it. Answer the same questions with
    ``importlib`` instead."""
    if not _once("mmengine_package_lookup"):
        return
    import mmengine.config.config as mm_config

    def is_installed(package: str) -> bool:
        try:
            importlib.metadata.distribution(package)
            return True
        except importlib.metadata.PackageNotFoundError:
            spec = importlib.util.find_spec(package)
            return spec is not None and spec.origin is not None

    def get_installed_path(package: str) -> str:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"package {package!r} is not installed")
        return os.path.dirname(spec.origin)

    mm_config.is_installed = is_installed
    mm_config.get_installed_path = get_installed_path


def apply_all() -> None:
    """Apply every patch sfttool needs (config loading and training)."""
    patch_mmengine_package_lookup()
