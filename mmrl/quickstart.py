"""The CPU quickstart: a tiny Qwen2.5-VL learns which colour a shape is, with GRPO, in minutes."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mmrl.config import load_config
from mmrl.config.recipes import recipe_dir
from mmrl.run.logger import read_metrics

# task -> its recipe; `zoom` is the agent quickstart (a tool call, then an answer), `game` a grid game
# played over several turns, each move answered by the next frame.
TASKS = {"colour": "quickstart.yaml", "zoom": "quickstart_agent.yaml", "game": "quickstart_game.yaml"}
GAME_SEEDS = {"train": list(range(4096)), "val": list(range(1_000_000, 1_000_100))}
ZOOM_DATA = {"n_train": 512, "n_val": 96, "seed": 0, "places": 1}  # the mark at one place (synthetic_zoom)


def recipe_of(task: str) -> Path:
    """The task's bundled recipe: inside the installed package, or the repository's `configs/`."""
    return recipe_dir() / TASKS[task]


def run_quickstart(out: str, overrides: list[str], task: str = "colour") -> int:
    from mmrl.agent.game import write_game_rows
    from mmrl.data.synthetic import generate
    from mmrl.data.synthetic_zoom import generate_zoom
    from mmrl.models import build_tiny
    from mmrl.trainer import Trainer

    console = Console()
    root = Path(out)
    model_dir, data_dir = root / "tiny-model", root / "data"
    if not (model_dir / "config.json").exists():
        console.print(f"building a tiny random-init Qwen2.5-VL in {model_dir}")
        build_tiny(model_dir, seed=0)
    cfg = load_config(recipe_of(task), [*paths(root, model_dir, data_dir), *overrides])
    if not (data_dir / "train.jsonl").exists():
        console.print(f"rendering the synthetic {task} task in {data_dir}")
        if task == "game":
            assert cfg.agent is not None and cfg.agent.game is not None
            write_game_rows(data_dir, cfg.agent.game.task, cfg.agent.game.options, GAME_SEEDS)
        elif task == "zoom":
            generate_zoom(data_dir, **ZOOM_DATA)
        else:
            generate(data_dir, task="color", n_train=2048, n_val=128, seed=0, image_size=112)
    set_aside_earlier_run(
        cfg.run_dir, root, console
    )  # the quickstart is a demo: each invocation starts afresh
    start = time.perf_counter()
    Trainer(cfg, console=console).fit()
    wall = time.perf_counter() - start
    summarise(console, cfg.run_dir, wall)
    return 0


def set_aside_earlier_run(run_dir: Path, root: Path, console: Console) -> Path | None:
    """Move the quickstart's earlier run in `root` (its --out folder) aside, as `run.<UTC time>`, so the
    new one starts afresh and nothing is lost; returns where it went. Any other folder that holds files
    (a `trainer.output_dir` elsewhere, perhaps someone's real run) is refused, never touched."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return None
    own = run_dir.resolve().parent == root.resolve()
    is_run = any((run_dir / name).exists() for name in ("metrics.jsonl", "checkpoints"))
    if not (own and is_run):
        what = "an earlier run" if is_run else "files but no earlier run"
        raise FileExistsError(
            f"{run_dir} holds {what}, and the quickstart starts its run afresh: give a new or empty folder as "
            f"trainer.output_dir, or leave it to the quickstart's own (--out {root})"
        )
    aside = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    while aside.exists():
        aside = aside.with_name(aside.name + "_")
    run_dir.rename(aside)
    console.print(f"the earlier quickstart run is kept in {aside}", markup=False)
    return aside


def paths(root: Path, model_dir: Path, data_dir: Path) -> list[str]:
    """The overrides that point a quickstart recipe at its folder."""
    return [
        f"model.path={model_dir}",
        f"data.train_files={data_dir / 'train.jsonl'}",
        f"data.val_files={data_dir / 'val.jsonl'}",
        f"trainer.output_dir={root / 'run'}",
    ]


def summarise(console: Console, run_dir: Path, wall_s: float) -> None:
    """Validation accuracy over training, and where the curve and checkpoints are."""
    records = read_metrics(run_dir / "metrics.jsonl")
    table = Table(title="validation accuracy (greedy, held-out prompts)")
    table.add_column("step", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("train reward", justify="right")
    for r in records:
        if "val/accuracy" in r:
            reward = r.get("reward/mean")
            table.add_row(
                str(r["step"]), f"{r['val/accuracy']:.3f}", "-" if reward is None else f"{reward:.3f}"
            )
    console.print(table)
    steps = [r["timing/step"] for r in records if "timing/step" in r]
    mean_step = sum(steps) / len(steps) if steps else float("nan")
    console.print(f"training wall time {wall_s:.0f} s, mean step {mean_step:.2f} s")
    console.print(f"reward curve: {run_dir / 'reward_curve.png'}   metrics: {run_dir / 'metrics.jsonl'}")
