"""Headless OpenGL for MuJoCo: choose the backend before mujoco is imported, and fail with a fix.

MuJoCo reads ``MUJOCO_GL`` once, when it is imported, and its default (GLFW) needs a display, which
env workers on servers never have. So every module here that renders imports mujoco through
``load_mujoco()``, which picks EGL (GPU drivers and Mesa's llvmpipe both provide it) unless the user
chose a backend, and OSMesa only when no EGL library exists.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mujoco

__all__ = ["INSTALL_HINT", "load_mujoco", "make_renderer"]

INSTALL_HINT = (
    "Headless rendering needs EGL (Debian/Ubuntu: apt-get install libegl1 libgl1-mesa-dri; NVIDIA "
    "drivers ship their own) or OSMesa (apt-get install libosmesa6, then set MUJOCO_GL=osmesa)"
)


def load_mujoco() -> ModuleType:
    """Import mujoco with a headless backend chosen: the user's ``MUJOCO_GL``, else egl, else osmesa."""
    if not os.environ.get("MUJOCO_GL") and "mujoco" not in sys.modules:
        if ctypes.util.find_library("EGL") is None and ctypes.util.find_library("OSMesa") is not None:
            warnings.warn(
                "libEGL not found, so MuJoCo renders with OSMesa, which is several times slower; "
                "install libegl1 for EGL",
                RuntimeWarning,
                stacklevel=2,
            )
            os.environ["MUJOCO_GL"] = "osmesa"
        else:
            os.environ["MUJOCO_GL"] = "egl"  # if EGL is missing too, make_renderer says what to install
    try:
        import mujoco
    except Exception as err:  # PyOpenGL fails with AttributeError, not ImportError, on a missing library
        raise RuntimeError(
            f"importing mujoco with MUJOCO_GL={os.environ.get('MUJOCO_GL')} failed ({err!r}). {INSTALL_HINT}."
        ) from err
    return mujoco


def make_renderer(model: mujoco.MjModel, height: int, width: int) -> mujoco.Renderer:
    """A ``mujoco.Renderer``, or a RuntimeError that names the backend and what to install."""
    mujoco = load_mujoco()
    try:
        return mujoco.Renderer(model, height=height, width=width)
    except Exception as err:
        backend = os.environ.get("MUJOCO_GL") or "unset (GLFW, which needs a display)"
        raise RuntimeError(
            f"MuJoCo could not create an offscreen OpenGL context with MUJOCO_GL={backend} ({err}). "
            f"{INSTALL_HINT}. MUJOCO_GL must be set before mujoco is first imported in the process."
        ) from err
