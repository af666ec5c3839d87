"""Validation galleries: pages with the images, responses and rewards, and an index of steps."""

from __future__ import annotations

import re

from PIL import Image

from mmrl.run.gallery import GalleryItem, write_gallery


def _items() -> list[GalleryItem]:
    red = Image.new("RGB", (112, 112), (220, 20, 20))
    return [
        GalleryItem([red], "<image>What colour?", "<answer>red</answer>", "red", 1.0, {"answer_match": 1.0}),
        GalleryItem([red], "<b>escape me</b>", "<answer>blue</answer>", "red", 0.1, {"answer_match": 0.0}),
        GalleryItem([], "text only", "no tags", "one", 0.0),
    ]


def test_page_shows_every_sample_with_its_image_answer_and_reward(tmp_path) -> None:
    page = write_gallery(tmp_path, 25, _items(), {"val/accuracy": 0.5, "val/mean": 0.37})
    text = page.read_text()
    assert page.name == "step_00000025.html"
    assert text.count('class="card') == 3
    assert text.count('class="card good"') == 1 and text.count('class="card bad"') == 2
    for src in re.findall(r'<img src="([^"]+)"', text):
        image = Image.open(page.parent / src)
        assert image.size == (112, 112)
    assert len(re.findall(r"<img ", text)) == 2
    assert "red / red" in text and "blue / red" in text and "None / one" in text
    assert "&lt;b&gt;escape me&lt;/b&gt;" in text and "<b>escape me" not in text
    assert "1.000 (answer_match 1.00)" in text


def test_index_lists_every_validation_step_in_order(tmp_path) -> None:
    write_gallery(tmp_path, 50, _items(), {"val/accuracy": 0.75, "val/mean": 0.7})
    write_gallery(tmp_path, 0, _items(), {"val/accuracy": 0.17, "val/mean": 0.2})
    index = (tmp_path / "gallery" / "index.html").read_text()
    links = re.findall(r'href="(step_\d+\.html)"', index)
    assert links == ["step_00000000.html", "step_00000050.html"]
    assert "0.170" in index and "0.750" in index
