"""Frames from a simulator's own scene cameras, for adapters of third-party MuJoCo benchmarks.

Meta-World and LIBERO each render through their own stacks (Gymnasium's renderer, robosuite's), at
settings made for human viewing. `CameraViews` renders their MuJoCo scene directly with `mujoco.Renderer`
at the policy's size, with shadows, reflections and multisampling off (several times faster on a CPU,
the same geometry and colours), turns each camera world-up (cameras mounted upside down are common:
Meta-World's corner cameras, robosuite's agent view), and tiles several cameras side by side into one
frame, so a third-person and a wrist view reach the policy as one image through history, demos and GIFs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.envs.gl import load_mujoco, make_renderer

mujoco = load_mujoco()


class CameraViews:
    """Render `cameras` of `model` at `image_size` squared each; `render(data)` tiles them left to right."""

    def __init__(self, model: Any, image_size: int, cameras: list[str], scene: str) -> None:
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
            raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
        known = [model.camera(i).name for i in range(model.ncam)]
        if not cameras:
            raise ValueError(f"name at least one camera; {scene}'s cameras are: {known}")
        for name in cameras:
            if name not in known:
                raise ValueError(f"camera {name!r} is not in {scene}'s scene; its cameras are: {known}")
        self.cameras = list(cameras)
        model.vis.quality.offsamples = 0
        offscreen = model.vis.global_
        offscreen.offwidth = max(offscreen.offwidth, image_size)
        offscreen.offheight = max(offscreen.offheight, image_size)
        self._renderer = make_renderer(model, image_size, image_size)
        for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
            self._renderer.scene.flags[flag] = False
        self._upside_down: dict[str, bool] = {}  # per camera, read once the scene has been placed

    def render(self, data: Any) -> np.ndarray:
        """image_size x (image_size x cameras) x 3 uint8, world-up at the top of every view."""
        return np.concatenate([self._view(data, name) for name in self.cameras], axis=1)

    def _view(self, data: Any, camera: str) -> np.ndarray:
        self._renderer.update_scene(data, camera=camera)
        frame = self._renderer.render()
        if camera not in self._upside_down:
            # The camera frame's y axis is the image's up: pointing down, the view is upside down.
            up = data.camera(camera).xmat.reshape(3, 3)[:, 1]
            self._upside_down[camera] = bool(up[2] < 0)
        return np.ascontiguousarray(frame[::-1, ::-1]) if self._upside_down[camera] else frame

    def close(self) -> None:
        self._renderer.close()
