"""The learning runs the suite asserts on: each recipe at test size, on its synthetic task.

The tests and `bench/learning_spread.py` train from these same definitions, so the spread written next to
each threshold was measured on exactly the run the test makes. A test-sized run keeps its recipe (the
algorithm, the model, the task) and only takes fewer steps; the recipes' full-length figures are in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from forked import run_python

from mmrl.data.synthetic import COLOURS, generate
from mmrl.data.synthetic_video import generate_video
from mmrl.models import DEFAULT_FAMILY
from mmrl.run.logger import read_metrics

REPO = Path(__file__).resolve().parent.parent
WARMUP_CACHE_ENV = "MMRL_TEST_WARMUP_CACHE"  # set by conftest.py for the whole test session


def colour_task(root: Path) -> None:
    """2,048 training and 64 held-out 112 px shapes in 6 colours: chance is 1/6."""
    generate(root, task="color", n_train=2048, n_val=64, seed=0, image_size=112)


def recolor_task(root: Path) -> None:
    """The colour a dot ends as over 4 frames (another colour before): chance is 1/4, and only the frames'
    order tells the two colours apart."""
    generate_video(root, n_train=2048, n_val=64, seed=0, task="recolor")


def hidden_colour_task(root: Path) -> None:
    """The colour task with every answer replaced by a colour drawn independently of its image, and the
    scene parameters (which name the colour) dropped: only a reward that reads the pixels can teach it.
    The format warm-up still sees the answer vocabulary; nothing sees the label."""
    colour_task(root)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        path = root / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            row["answer"] = str(rng.choice(list(COLOURS)))
            del row["params"]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def game_task(root: Path) -> None:
    """The game quickstart's rows: the first frames of 4,096 training seeds and the 100 held-out ones."""
    from mmrl.agent.game import write_game_rows
    from mmrl.config import load_config
    from mmrl.quickstart import GAME_SEEDS

    game = load_config(REPO / "configs" / "quickstart_game.yaml").agent.game
    write_game_rows(root, game.task, game.options, GAME_SEEDS)


def zoom_task(root: Path) -> None:
    """The agent quickstart's rows: 512 training and 96 held-out scenes whose striped mark, at its one
    place, is legible only through `image_zoom`; chance is 1/3."""
    from mmrl.data.synthetic_zoom import generate_zoom
    from mmrl.quickstart import ZOOM_DATA

    generate_zoom(root, **ZOOM_DATA)


@dataclass(frozen=True)
class LearningRun:
    """One recipe at test size: `steps` RL steps after the recipe's warm-up, validated before and after.
    `min_gain` is the least rise of the validation `metric` the test accepts. A run without a `task` is a
    simulator recipe: behaviour cloning from the env's expert (`mmrl sft`), then episode GRPO."""

    config: str
    task: Callable[[Path], None] | None
    steps: int
    min_gain: float
    overrides: tuple[str, ...] = ()
    metric: str = "val/accuracy"
    family: str = DEFAULT_FAMILY  # of the tiny random-init model the run starts from
    # With `val_every`, the run validates that often and ends at the first validation `min_gain` above
    # the one before training (`trainer.stop_at_gain`): every run that would pass at `steps` passes,
    # most sooner, and a run that learns nothing still trains all `steps` and fails.
    val_every: int | None = None
    # The seeds tried in turn until one rises (None: the config's): for a recipe whose seeds do not all
    # learn within `steps`, the claim is that it learns at one of them; for one whose seeds all learn, the
    # seed that learned soonest.
    seeds: tuple[int | None, ...] = (None,)
    # A run whose gain is counted from chance, not from its step-0 validation (a warm-up policy that,
    # played greedily, scores below chance): it stops at `chance + min_gain` (`trainer.stop_at`).
    chance: float | None = None

    def gain(self, first: float, value: float) -> float:
        """How far `value` is above where the run's gain counts from: chance, or its step-0 `first`."""
        return value - (first if self.chance is None else self.chance)


# Each threshold keeps a margin below the worst gain in held-out accuracy measured for its run over seeds
# 1-3 and both kinds of x86 numerics (`bench/learning_spread.py`, 2026-11-24, docs/benchmarks.md). After
# the warm-up a colour run answers one colour (0.16-0.17 on the 64 held-out images), and a run that learns
# nothing stays there exactly, so any positive threshold fails a broken learner (`actor.lr=0` gives a gain
# of exactly 0). Learning goes colour by colour: +0.16 is the first colour learned beyond the warm-up's.
COLOUR_STEPS = 100  # the colour and clip runs' RL steps at test size

# A run that learns at every seed measured runs at the seed that reached its threshold soonest: its test
# costs the least, and a learner that is broken or slowed still fails it (2026-12-06, seeds 1-3 AVX2,
# docs/benchmarks.md "Each learning run at its quickest seed").
RUNS: dict[str, LearningRun] = {
    # The quickstart as the README runs it (tests/test_learning.py; also from a tiny Qwen3-VL below):
    # gains 0.47, 0.47, 0.44 (2026-11-24); 0.34 and 0.30 at seeds 2 and 3 (2026-12-06), where seed 1 reads
    # 0.50 at step 80 and ends at 0.33; seed 2 reaches 0.25 at step 60. On the 2-core AMD EPYC VM without
    # AVX-512 of 2026-12-08 (the same curve with the code of 2026-12-07, so its numerics, not the code):
    # seed 2 learns one colour, +0.156 at step 60 and +0.17 at 100; seed 3 +0.156 from step 50, +0.31 at
    # 100. So the threshold is the first colour learned with a margin (a learner that learns nothing
    # gains exactly 0), and seed 3 follows where seed 2 does not reach it.
    "grpo": LearningRun(
        "configs/quickstart.yaml", colour_task, steps=COLOUR_STEPS, min_gain=0.12, val_every=10, seeds=(2, 3)
    ),
    # the same recipe on two FSDP2 workers (each samples its own half): gain 0.47 at seed 1. Measured with
    # bench/learning_spread.py only: the suite checks the two-worker update against one process's exactly.
    "grpo_2workers": LearningRun(
        "configs/quickstart.yaml",
        colour_task,
        steps=COLOUR_STEPS,
        min_gain=0.3,
        overrides=("trainer.n_gpus_per_node=2",),
    ),
    # the quickstart with overlapped rollouts: a rollout worker samples each batch one update behind
    # (rollout.max_staleness=1), truncated importance sampling corrects for it. Ends at 0.42, 0.63, 0.63
    # (gains 0.25, 0.45, 0.45, seeds 1-3) where the synchronous run ends at 0.59, 0.50, 0.66 on the same
    # machine (2026-11-25, AVX2 numerics, docs/benchmarks.md). On 2026-12-06: gains 0.16 and 0.45 at seeds 2
    # and 3, seed 3 at the threshold by step 50; +0.16 is the first colour learned beyond the warm-up's.
    "async": LearningRun(
        "configs/quickstart.yaml",
        colour_task,
        steps=COLOUR_STEPS,
        min_gain=0.1,
        val_every=10,
        seeds=(3,),
        overrides=("rollout.max_staleness=1", "actor.rollout_correction=tis"),
    ),
    # the clip task `recolor`, chance 1/4; gains 0.50, 0.55, 0.50 (seeds 1-3, AVX2) and 0.25, 0.66, 0.75
    # (native). Learning goes colour by colour: +0.25 is the first colour beyond the warm-up's. On
    # 2026-12-06 (AVX2): seed 1 at the threshold by step 80, seeds 2 and 3 by 50 and 30 (gains 0.50, 0.50).
    "video": LearningRun(
        "configs/quickstart_video.yaml",
        recolor_task,
        steps=COLOUR_STEPS,
        min_gain=0.15,
        val_every=10,
        seeds=(3,),
    ),
    # gains 0.31, 0.16, 0.16 (2026-11-24); 0.38 and 0.63 at seeds 2 and 3 (2026-12-06), at the threshold by
    # steps 70 and 40, seed 1 by 60
    "dapo": LearningRun(
        "configs/quickstart_dapo.yaml",
        colour_task,
        steps=COLOUR_STEPS,
        min_gain=0.1,
        val_every=10,
        seeds=(3,),
    ),
    # gains 0.52, 0.16 (seeds 1 and 2; 2026-11-24); 0.42 and 0.48 at seeds 2 and 3 (2026-12-06)
    "drgrpo": LearningRun(
        "configs/quickstart_drgrpo.yaml", colour_task, steps=COLOUR_STEPS, min_gain=0.1, val_every=10
    ),
    # gains 0.67, 0.59, 0.17 (2026-11-24); 0.30 and 0.36 at seeds 2 and 3 (2026-12-06)
    "ppo": LearningRun(
        "configs/quickstart_ppo.yaml", colour_task, steps=COLOUR_STEPS, min_gain=0.1, val_every=10
    ),
    # gains 0.23, 0.17, 0.56 (2026-11-24). On 2026-12-06 (AVX2): seed 1 at the threshold by step 30, seed 3
    # gains 0.19 (by step 70), and seed 2 does not learn in 100 steps (-0.02): seeds 1 and 3 are tried in turn.
    "lora": LearningRun(
        "configs/quickstart_lora.yaml",
        colour_task,
        steps=COLOUR_STEPS,
        min_gain=0.1,
        val_every=10,
        seeds=(1, 3),
    ),
    # gains 0.16, 0.13, 0.31 (2026-11-24). Eager, as every other vLLM test runs it: the compiled graph
    # decodes this tiny model no faster and costs a compilation at start, 20 s or more on a fresh machine.
    # Eager and compiled take the same path here (seed 1 ends at 0.484 both ways, stopping at step 70);
    # eager gains 0.31, 0.17, 0.17 (seeds 1-3, AVX2, 2026-12-06, 2-core AMD EPYC), at the threshold by steps
    # 70, 60 and 40.
    "vllm": LearningRun(
        "configs/quickstart.yaml",
        colour_task,
        steps=COLOUR_STEPS,
        min_gain=0.08,
        val_every=10,
        seeds=(3,),
        overrides=(
            "rollout.engine=vllm",
            "rollout.vllm.max_model_len=512",
            "rollout.vllm.enforce_eager=true",
        ),
    ),
    # gains 0.48, 0.33, 0.33 (2026-11-24); 0.19, 0.14, 0.36 with the shared-prompt forward and the HF
    # engine's own sampler (seeds 1-3, 2026-12-02, AVX2, 2-core AMD EPYC); 0.14, 0.17 at seeds 2, 3 (2026-12-06)
    "custom_reward": LearningRun(
        "examples/custom_reward/config.yaml",
        hidden_colour_task,
        steps=COLOUR_STEPS,
        min_gain=0.1,
        val_every=10,
    ),
    # The GRPO quickstart from a tiny Qwen3-VL, at 128 px: on its 32-pixel grid that is Qwen2.5-VL's 16
    # visual tokens (the 112 px images would be 9). With the shared-prompt forward and the HF engine's own
    # sampler (2026-12-02, AVX2 numerics, 2-core AMD EPYC): gains 0.14, 0.17, 0.52 at seeds 1-3, where
    # transformers' generate had given 0.46 or more over seeds 1-4 (2026-11-24): the runs take other
    # paths from the first float-rounding difference, and this recipe's spread is wide. After the stacked
    # vision attention (same values to rounding): 0.00, 0.17, 0.52 (2026-12-03; 0.00, 0.17, 0.48 at lr
    # 2e-3), so the test tries seeds 3, 2, 1 in turn: the surest first, as a run that rises stops early
    # and one that does not trains all its steps.
    "qwen3_vl": LearningRun(
        "configs/quickstart.yaml",
        colour_task,
        steps=COLOUR_STEPS,
        min_gain=0.1,
        val_every=10,
        overrides=("data.min_pixels=16384", "data.max_pixels=16384"),
        seeds=(3, 2, 1),
        family="qwen3_vl",
    ),
    # The quickstart's recipe with LLaVA-OneVision's architecture (SigLIP crops at any resolution, image
    # newlines, a Qwen2 language model, 1-D positions): the non-Qwen family that learns in the suite, from
    # chance to 0.8 held-out accuracy. Over 200 steps (AVX2, 2026-12-04): seed 1 0.17 -> 0.83 at step 90,
    # seed 3 -> 0.84 at step 110, seed 2 -> 0.67 from step 110 on; so seeds 1 and 3 are tried in turn,
    # and the run ends at the first validation at 0.8.
    "llava_onevision": LearningRun(
        "configs/quickstart.yaml",
        colour_task,
        steps=200,
        min_gain=0.8 - 1 / 6,
        val_every=10,
        seeds=(1, 3),
        chance=1 / 6,
        family="llava_onevision",
    ),
    # The game quickstart: greedy success on the 100 held-out seeds after 25 GiGPO steps from the
    # random-move warm-up. Gains 0.50, 0.85, 0.11 (0.08 -> 0.58, 0.93, 0.18; seeds 1-3, 2026-11-26, the 2-core
    # AMD VM, docs/benchmarks.md "Games"): how soon a seed finds the way varies widely. A policy that
    # learns nothing stays at the warm-up's 0.07-0.08 exactly (greedy play on fixed seeds).
    "game": LearningRun(
        "configs/quickstart_game.yaml",
        game_task,
        steps=25,
        min_gain=0.05,
        val_every=5,
        metric="val/env_success",
    ),
    # The agent quickstart at full length: a tool call, then an answer read from the zoomed crop. A policy
    # that does not read the crop answers one colour, 0.33 exactly, as the no-tool baseline does at every
    # validation; so the gain is counted from chance (a greedy warm-up policy that does not finish its
    # calls scores 0.00). With each turn weighed alike (`seq-mean-turn-mean`), greedy held-out accuracy
    # first passes 0.48 at steps 15, 25 and 20 for seeds 1-3 and reads 1.00 at step 30; seed 4 zooms onto
    # the mark from step 15 but reads 0.33 to step 30 (AVX2, 2026-12-06, 2-core AMD EPYC). Weighed per
    # token, seeds 1 and 2 read 0.67 at step 30 and 0.33 at 25. So seeds 1 and 3 are tried in turn.
    # Validated every 5 steps (validation draws nothing from the training run's random streams, so it
    # does not change the run), the run ends at the first validation 0.15 above chance.
    "zoom": LearningRun(
        "configs/quickstart_agent.yaml",
        zoom_task,
        steps=30,
        min_gain=0.15,
        val_every=5,
        seeds=(1, 3),
        chance=1 / 3,
    ),
    # Success over 100 evaluation episodes, sampled. RL's gain over the behaviour-cloned policy after 20 steps:
    # +0.17, +0.08, +0.12 (seeds 1-3, AVX2, 2026-12-04; +0.07, -0.01, +0.07 on 2026-11-24, before the
    # shared-prompt forward and the HF engine's own sampler). Validated every 10 steps, the run ends at the
    # first validation 0.04 above the clone; the rise from the untrained policy is asserted in
    # tests/test_vla_learning.py.
    "vla": LearningRun(
        "configs/vla_mujoco_reach.yaml", None, steps=20, min_gain=0.04, val_every=10, metric="val/success"
    ),
}


def train(
    name: str, root: Path, model_dir: Path, seed: int | None = None, extra: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """`mmrl train` on run `name` in `root` (data rendered there unless present); its metrics records."""
    run = RUNS[name]
    if run.task is None:
        return _train_episodes(run, root, model_dir, seed, extra)
    data = task_data(run.task, root / "data")
    out = root / "run"
    args = [
        "train",
        str(REPO / run.config),
        f"model.path={model_dir}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        f"trainer.output_dir={out}",
        *_shape(run, seed, extra),
    ]
    # A fresh process, as `bench/learning_spread.py` runs it: an RL run turns any last-bit difference into
    # another trajectory, and state that earlier tests leave in the test process (a kernel chosen, a
    # library's patch) would make the suite's run differ from the one the threshold was measured on.
    # Forked from a process that has only imported the training stack (`forked.py`), it starts as a fresh
    # interpreter does, without the imports' 6 s.
    log = root / "train.log"
    root.mkdir(parents=True, exist_ok=True)
    code = run_python(["-m", "mmrl.cli", *args], log).wait()
    assert code == 0, f"mmrl train exited with {code}:\n{log.read_text()[-4000:]}"
    return read_metrics(out / "metrics.jsonl")


# Each task's data, rendered once per process: every task is seeded, and no run writes to its data.
_RENDERED: dict[Callable[[Path], None], Path] = {}


def task_data(task: Callable[[Path], None], fresh: Path) -> Path:
    """The folder holding `task`'s data, rendered into `fresh` the first time this process asks for it."""
    if task not in _RENDERED or not (_RENDERED[task] / "train.jsonl").exists():
        task(fresh)
        _RENDERED[task] = fresh
    return _RENDERED[task]


def warmup_cache() -> list[str]:
    """The session's shared `warmup.cache_dir` (`conftest.warmup_cache`), as an override; none outside
    pytest. A run that reuses a warm-up trains exactly as one that makes its own (test_warmup_cache.py)."""
    cache = os.environ.get(WARMUP_CACHE_ENV)
    return [f"warmup.cache_dir={cache}"] if cache else []


def _shape(run: LearningRun, seed: int | None, extra: tuple[str, ...]) -> list[str]:
    """The overrides that make a recipe its test-size run: steps, validation before and after (and on the
    way, to stop at the run's target), no checkpoints or progress bars, the seed, the shared warm-up cache,
    the run's own overrides and the caller's."""
    return [
        *warmup_cache(),
        f"trainer.total_steps={run.steps}",
        f"trainer.val_every={run.val_every or run.steps}",
        *([_stop_target(run)] if run.val_every else []),
        "trainer.save_every=0",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        *([f"trainer.seed={seed}"] if seed is not None else []),
        *run.overrides,
        *extra,
    ]


def _stop_target(run: LearningRun) -> str:
    """The override that ends `run` at the first validation meeting its target."""
    if run.chance is None:
        return f"trainer.stop_at_gain={{{run.metric}: {run.min_gain + 1e-6}}}"
    return f"trainer.stop_at={{{run.metric}: {run.chance + run.min_gain + 1e-6}}}"


def _train_episodes(
    run: LearningRun, root: Path, model_dir: Path, seed: int | None, extra: tuple[str, ...]
) -> list[dict[str, Any]]:
    """`mmrl sft` from `model_dir`, then episode GRPO from the cloned policy; the RL run's records."""
    from mmrl.config import load_config
    from mmrl.trainer import Trainer
    from mmrl.vla.sft import run_sft

    cfg = load_config(
        REPO / run.config,
        [
            f"model.path={root / 'sft-model'}",
            f"sft.base_model={model_dir}",
            f"trainer.output_dir={root / 'run'}",
            *_shape(run, seed, extra),
        ],
    )
    run_sft(cfg)
    Trainer(cfg).fit()
    return read_metrics(root / "run" / "metrics.jsonl")


@dataclass(frozen=True)
class Trained:
    """The last run `train_until_learned` made: its folder, seed, records, and the rise of its metric."""

    root: Path
    seed: int | None
    records: list[dict[str, Any]]
    last_step: int
    first: float
    last: float


def train_until_learned(name: str, root: Path, model_dir: Path) -> Trained:
    """Run `name` at each of its `seeds` in turn until one gains its `min_gain`: that run, or the last one
    tried when none did (the caller's assertion then fails on it). The first seed trains in `root`."""
    run = RUNS[name]
    for i, seed in enumerate(run.seeds):
        where = root if i == 0 else root / f"seed{seed}"
        records = train(name, where, model_dir, seed=seed)
        last_step, first, last = rise(run, records)
        if run.gain(first, last) >= run.min_gain:
            break
    return Trained(where, seed, records, last_step, first, last)


def validations(records: list[dict[str, Any]], key: str = "val/accuracy") -> list[tuple[int, float]]:
    """(step, value) of every validation in a run's records."""
    return [(r["step"], r[key]) for r in records if key in r]


def rise(run: LearningRun, records: list[dict[str, Any]]) -> tuple[int, float, float]:
    """(last step, first, last value) of the run's validation metric: first at step 0, last where the run
    ended, at its `steps` or at the first validation that met its stop target."""
    val = validations(records, run.metric)
    (first_step, first), (last_step, last) = val[0], val[-1]
    assert first_step == 0, f"no validation before training: {val}"
    stopped = run.val_every is not None and run.gain(first, last) >= run.min_gain
    assert last_step == run.steps or stopped, f"the run ended at step {last_step} of {run.steps}: {val}"
    return last_step, first, last
