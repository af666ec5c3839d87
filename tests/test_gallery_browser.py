"""The validation gallery in a real headless Chromium: every image loads (natural width > 0), a broken
one is flagged on the page, and the screenshot shows the pictures.

Needs the `chromium` Debian package; `.ci/run` installs it. Elsewhere the test is skipped with the
command to install it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmrl.run.gallery import GalleryItem, write_gallery

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs headless Chromium: apt-get install -y --no-install-recommends chromium"
)
MAGENTA = (255, 0, 255)  # a colour nothing else on the page uses, to find the images in the screenshot


def _browser(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            "--allow-file-access-from-files",
            "--virtual-time-budget=5000",  # let the load handler run before the dump
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def _page(tmp_path: Path) -> Path:
    items = [
        GalleryItem(
            [Image.new("RGB", (112, 112), MAGENTA)], "<image>What colour?", "<answer>red</answer>", "red", 1.0
        ),
        GalleryItem(
            [Image.new("RGB", (56, 140), MAGENTA)], "<image>Which?", "<answer>blue</answer>", "red", 0.0
        ),
        GalleryItem([], "text only", "no tags", "one", 0.0),
    ]
    return write_gallery(tmp_path, 100, items, {"val/accuracy": 0.33})


def _image_marks(page: Path) -> tuple[list[str], str]:
    dom = _browser("--dump-dom", page.as_uri()).stdout
    loaded = re.findall(r'<img [^>]*data-loaded="(yes|no)"', dom)
    broken = re.search(r'<body[^>]*data-broken-images="(\d+)"', dom)
    assert broken is not None, "the page's image check did not run"
    return loaded, broken.group(1)


def test_every_gallery_image_loads_in_chromium(tmp_path) -> None:
    loaded, broken = _image_marks(_page(tmp_path))
    assert loaded == ["yes", "yes"] and broken == "0"


def test_a_missing_image_is_flagged_on_the_page(tmp_path) -> None:
    page = _page(tmp_path)
    next((page.parent / "step_00000100").glob("0001_*.png")).unlink()
    loaded, broken = _image_marks(page)
    assert loaded == ["yes", "no"] and broken == "1"


def test_screenshot_shows_the_images(tmp_path) -> None:
    shot = tmp_path / "shot.png"
    _browser("--window-size=1200,900", f"--screenshot={shot}", _page(tmp_path).as_uri())
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    magenta = (np.abs(pixels - MAGENTA).sum(axis=-1) < 30).sum()
    # Two images of 112x112 and 56x140 px (≈ 20k px), drawn at least at natural size in the cards.
    assert magenta > 15_000, f"only {magenta} magenta pixels: the images did not render"
