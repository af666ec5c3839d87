"""examples/custom_reward: the pixel-reading reward agrees with the synthetic task's labels without reading
them, scores wrong or unformatted answers 0, and its config is the quickstart recipe with another reward."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from PIL import Image

from mmrl.cli import build_parser
from mmrl.config import load_config
from mmrl.data.synthetic import BACKGROUND, TASKS
from mmrl.rewards import RewardInput, RewardManager

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_reward"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dominant_colour_example", EXAMPLE / "dominant_colour.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reads_the_labelled_colour_off_the_pixels() -> None:
    example = _example()
    rng = np.random.default_rng(0)
    task = TASKS["color"]
    rendered = [task.render(rng, 112) for _ in range(150)] + [task.render(rng, 56) for _ in range(50)]
    agree = sum(example.dominant_colour_name(image) == answer for image, answer, _ in rendered)
    assert agree / len(rendered) >= 0.99, f"agrees with the labels on {agree} of {len(rendered)} images"


@pytest.mark.parametrize(
    ("response", "overall", "answer_given"),
    [
        ("<answer>red</answer>", 1.0, 1.0),
        ("<answer> Red. </answer>", 1.0, 1.0),
        ("<answer>blue</answer>", 0.0, 1.0),  # the dataset's label, but not the image's colour
        ("red", 0.0, 0.0),  # right colour, no answer format
        ("<answer></answer>", 0.0, 0.0),
    ],
)
def test_scores_the_answer_against_the_image_not_the_label(
    response: str, overall: float, answer_given: float
) -> None:
    image, answer, _ = TASKS["color"].render(np.random.default_rng(1), 112, answer="red")
    assert answer == "red"
    sample = RewardInput(response=response, ground_truth="blue", images=[image])
    assert _example().dominant_colour(sample) == {"overall": overall, "answer_given": answer_given}


def test_an_image_without_a_shape_names_no_colour() -> None:
    example = _example()
    blank = Image.new("RGB", (112, 112), BACKGROUND)
    assert example.dominant_colour_name(blank) is None
    sample = RewardInput(response="<answer>red</answer>", images=[blank])
    assert example.dominant_colour(sample)["overall"] == 0.0
    assert example.dominant_colour(RewardInput(response="<answer>red</answer>"))["overall"] == 0.0


def test_config_is_the_quickstart_recipe_with_the_pixel_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(EXAMPLE.parent.parent)  # the README's instruction: run from the repo root
    example = load_config(EXAMPLE / "config.yaml").model_dump()
    quickstart = load_config("configs/quickstart.yaml").model_dump()
    differing = {
        f"{section}.{key}"
        for section, values in example.items()
        if values is not None  # optional sections (env, sft) that neither config has
        for key, value in values.items()
        if quickstart[section][key] != value
    }
    assert differing == {
        "model.path",
        "data.train_files",
        "data.val_files",
        "reward.functions",
        "trainer.output_dir",
        "trainer.experiment_name",
    }
    with RewardManager(example["reward"]["functions"]) as manager:
        image, _, _ = TASKS["color"].render(np.random.default_rng(2), 112, answer="green")
        result = manager.score([RewardInput(response="<answer>green</answer>", images=[image])])
    assert result.components["dominant_colour"] == [1.0]
    assert result.overall == pytest.approx([1.0])  # 0.9 · colour + 0.1 · format


def test_readme_commands_build_what_the_config_reads() -> None:
    readme = (EXAMPLE / "README.md").read_text()
    (block,) = re.findall(r"```bash\n(.+?)\n```", readme, flags=re.S)
    init, synth, train = (build_parser().parse_args(shlex.split(line)[1:]) for line in block.splitlines())
    cfg = load_config(EXAMPLE / "config.yaml")
    assert Path(init.out_dir) == Path(cfg.model.path)
    assert [Path(synth.out_dir) / f"{split}.jsonl" for split in ("train", "val")] == [
        Path(cfg.data.train_files[0]),
        Path(cfg.data.val_files[0]),
    ]
    assert synth.image_size**2 == cfg.data.max_pixels  # images reach the model, and the reward, unresized
    assert (train.command, train.config) == ("train", "examples/custom_reward/config.yaml")
