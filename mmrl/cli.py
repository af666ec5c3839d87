"""`mmrl` command line: train, sft, eval, export, quickstart, plan, config show, model init-tiny, data synth."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from rich.console import Console

from mmrl.config import Config, dump_config, load_config
from mmrl.config.recipes import resolve_config
from mmrl.envs.registry import EnvOptionError
from mmrl.errors import ConfigError, RunStopped
from mmrl.run.logger import DISK_FULL
from mmrl.run.signals import RunInterrupted
from mmrl.sources.startup import check_family, check_startup


def _load(args: argparse.Namespace) -> Config:
    """The command's config: a file, or a bundled recipe by name (said on stderr, so the run's log shows it)."""
    path, note = resolve_config(args.config)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return load_config(path, args.overrides)


def _train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    check_startup(cfg, "train")
    for applied in cfg.paper_defaults:
        print(f"paper default (the config leaves it unset): {applied}", file=sys.stderr)
    from mmrl.trainer import Trainer

    Trainer(cfg, resume=args.resume).fit()
    return 0


def _sft(args: argparse.Namespace) -> int:
    from mmrl.vla.sft import run_sft

    cfg = _load(args)
    if cfg.sft is None or cfg.env is None:
        raise ConfigError(f"{args.config} has no env and sft sections; see configs/vla_mujoco_reach.yaml")
    check_startup(cfg, "sft")
    _output_folder(cfg.model.path, args.force, "the cloned policy (model.path)")
    run_sft(cfg)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from mmrl.evaluate.prompts import evaluate, print_table, resolve_checkpoint

    cfg = _load(args)
    resolve_checkpoint(args.checkpoint)  # the model to score is the first thing a mistake can be in
    if args.out is not None:
        _output_file(args.out, args.force, "the evaluation's results")
    check_startup(cfg, "eval")
    if cfg.env is not None:
        from mmrl.evaluate.episodes import evaluate_episodes

        print_table(evaluate_episodes(cfg, args.checkpoint, episodes=args.episodes, out=args.out), Console())
        return 0
    result = evaluate(
        cfg,
        args.checkpoint,
        n=args.n,
        temperature=args.temperature,
        k=args.k,
        correct_threshold=args.threshold,
        out=args.out,
    )
    print_table(result, Console())
    return 0


def _export(args: argparse.Namespace) -> int:
    from mmrl.evaluate.prompts import resolve_checkpoint
    from mmrl.training.lora import export_plain

    out = export_plain(resolve_checkpoint(args.checkpoint), Path(args.out))
    print(f"plain transformers checkpoint written to {out}")
    return 0


def _config_show(args: argparse.Namespace) -> int:
    if args.doc is not None:
        from mmrl.config.reference import describe

        print(describe(args.doc))
        return 0
    if args.config is None:
        raise ConfigError("mmrl config show needs a CONFIG (a file or a recipe's name), or --doc KEY")
    cfg = _load(args)
    print(dump_config(cfg), end="")
    for applied in cfg.paper_defaults:
        print(f"# paper default, as the config leaves it unset: {applied}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from mmrl.workers.memory import gpu_kind, plan_memory, shape_for, what_fits

    cfg = _load(args)
    gpu = gpu_kind(args.gpu)
    shape = shape_for(cfg)
    plan = plan_memory(cfg, shape, gpu)
    print(
        f"{cfg.model.path}: {shape.params / 1e9:.2f} B parameters ({shape.vision_params / 1e9:.2f} B in the vision tower)"
    )
    print(plan.table())
    if not plan.fits:
        fixes = what_fits(cfg, shape, gpu)
        print(
            f"to fit: {' '.join(fixes)}"
            if fixes
            else "no single-GPU setting fits: more GPUs, LoRA or a larger GPU"
        )
    return 0 if plan.fits else 1


def _output_folder(path: str | Path, force: bool, what: str) -> Path:
    """The folder a command writes `what` into: new or empty, or any folder with --force.

    A mistyped path must not replace a model's weights or a labelled data set without a word, so a
    folder that holds anything is refused, naming it and the flag; --force writes into it, replacing
    files of the same names."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; give a new or empty folder to write {what} into")
    if not force and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} is not empty; give a new or empty folder for {what}, or pass --force to write into it "
            "(files of the same names are replaced)"
        )
    return out


def _output_file(path: str | Path, force: bool, what: str) -> Path:
    """The file a command writes `what` into: new, or an existing one with --force. Checked before the
    work, so a mistyped path (a data set's `train.jsonl`) is refused at once, not replaced at the end."""
    out = Path(path)
    if out.is_dir():
        raise FileExistsError(f"{out} is a folder; give a file name to write {what} to")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; give a new file name for {what}, or pass --force to replace it")
    return out


def _init_tiny(args: argparse.Namespace) -> int:
    from mmrl.models import build_tiny

    check_family("--family", args.family)
    out = build_tiny(
        _output_folder(args.out_dir, args.force, "the model"), family=args.family, seed=args.seed
    )
    print(f"tiny {args.family} model written to {out}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    from mmrl.data.synthetic import generate
    from mmrl.data.synthetic_geometry import DEFAULT_IMAGE_SIZE, generate_geometry
    from mmrl.data.synthetic_video import VIDEO_TASKS, generate_video

    defaults = {"geometry": DEFAULT_IMAGE_SIZE, **dict.fromkeys(VIDEO_TASKS, 112)}
    size = args.image_size if args.image_size is not None else defaults.get(args.task, 56)
    options = {"n_train": args.n_train, "n_val": args.n_val, "seed": args.seed, "image_size": size}
    _output_folder(args.out_dir, args.force, "the data set")
    try:
        if args.task == "geometry":
            meta = generate_geometry(args.out_dir, **options)
        elif args.task in VIDEO_TASKS:
            meta = generate_video(args.out_dir, task=args.task, **options)
        else:
            meta = generate(args.out_dir, task=args.task, **options)
    except ValueError as err:  # a bad --image-size or count: a usage error, not a crash
        raise ConfigError(str(err)) from None
    print(
        f"{meta['n_train']} train / {meta['n_val']} val rows of task {args.task!r} written to {args.out_dir}"
    )
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from mmrl.quickstart import run_quickstart

    return run_quickstart(args.out, args.overrides, args.task)


def _positive(text: str) -> int:
    """A count that must be at least 1 (argparse prints the one-line usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a count of at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from mmrl.data.synthetic import TASKS

    parser = argparse.ArgumentParser(
        prog="mmrl", description="RL for vision-language models and VLA policies."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train with a YAML config; overrides as key.sub=value")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", default=[], help="e.g. actor.lr=1e-5 trainer.total_steps=10")
    train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    train.set_defaults(func=_train)

    ev = sub.add_parser(
        "eval",
        help="score a checkpoint on data.val_files (accuracy, pass@k), or an env config's success rate",
    )
    ev.add_argument("config")
    ev.add_argument("overrides", nargs="*", default=[], help="e.g. data.val_files=test.parquet")
    ev.add_argument(
        "--checkpoint", required=True, help="a run folder, a checkpoints/step_N folder or a model folder"
    )
    ev.add_argument(
        "--n", type=_positive, default=1, help="samples per prompt; 1 decodes like validation (greedy)"
    )
    ev.add_argument(
        "--temperature", type=float, default=None, help="for --n > 1 (default: rollout.temperature)"
    )
    ev.add_argument(
        "--k", type=_positive, nargs="+", default=None, help="pass@k values to report (default: 1 and n)"
    )
    ev.add_argument(
        "--threshold", type=float, default=0.5, help="accuracy score counted as correct for pass@k"
    )
    ev.add_argument(
        "--out",
        default=None,
        help="a new JSON file (default: eval_*.json beside the model, rewritten each time)",
    )
    ev.add_argument("--force", action="store_true", help="replace the --out file if it exists")
    ev.add_argument(
        "--episodes",
        type=_positive,
        default=None,
        help="env configs: evaluation episodes (default: env.val_episodes)",
    )
    ev.set_defaults(func=_eval)

    sft = sub.add_parser("sft", help="env configs: behaviour-clone scripted demos into model.path")
    sft.add_argument("config")
    sft.add_argument("overrides", nargs="*", default=[], help="e.g. sft.demos=400")
    sft.add_argument(
        "--force",
        action="store_true",
        help="write into a folder that is not empty (files of the same names are replaced)",
    )
    sft.set_defaults(func=_sft)

    export = sub.add_parser("export", help="write a checkpoint as a plain HF model folder (LoRA merged)")
    export.add_argument("checkpoint", help="a run folder, a checkpoints/step_N folder or a model folder")
    export.add_argument("out", help="an empty or new folder")
    export.set_defaults(func=_export)

    quick = sub.add_parser(
        "quickstart", help="build a tiny model and a visual task, then train it on this CPU"
    )
    quick.add_argument("--out", default="runs/quickstart", help="folder for the model, data and run")
    quick.add_argument(
        "--task",
        choices=("colour", "zoom", "game"),
        default="colour",
        help="colour: name a shape's colour (configs/quickstart.yaml); zoom: an agent that must call "
        "image_zoom to read a small mark (configs/quickstart_agent.yaml, --out runs/quickstart_agent); "
        "game: walk to a coloured cell of a grid, a frame each turn (configs/quickstart_game.yaml)",
    )
    quick.add_argument("overrides", nargs="*", default=[], help="overrides for the task's recipe")
    quick.set_defaults(func=_quickstart)

    config = sub.add_parser("config", help="inspect configs").add_subparsers(dest="action", required=True)
    show = config.add_parser("show", help="print the resolved, validated config")
    show.add_argument("config", nargs="?")
    show.add_argument("overrides", nargs="*", default=[])
    show.add_argument("--doc", metavar="KEY", help="print one key's type, default, allowed values and doc")
    show.set_defaults(func=_config_show)

    plan = sub.add_parser(
        "plan", help="per-GPU memory of a config at rollout and update, and whether it fits"
    )
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", default=[])
    plan.add_argument(
        "--gpu", default="h100-80g", help="the GPU kind: a100-40g, a100-80g, h100-80g, h200-141g, ..."
    )
    plan.set_defaults(func=_plan)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="action", required=True)
    tiny = model.add_parser(
        "init-tiny", help="write a random-init tiny model of a family, with its own tokenizer"
    )
    tiny.add_argument("out_dir")
    tiny.add_argument("--family", default="qwen2_5_vl", help="model family (README: supported models)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--force",
        action="store_true",
        help="write into a folder that is not empty (files of the same names are replaced)",
    )
    tiny.set_defaults(func=_init_tiny)

    data = sub.add_parser("data", help="dataset utilities").add_subparsers(dest="action", required=True)
    synth = data.add_parser("synth", help="write a seeded synthetic visual task (jsonl + png)")
    synth.add_argument("out_dir")
    synth.add_argument(
        "--task",
        default="color",
        choices=[*sorted(TASKS), "geometry", "recolor", "motion"],
        help="geometry: labelled triangles, circles and angles with exact answers; recolor: mp4 clips of a "
        "dot that changes colour (what colour at the end?); motion: mp4 clips of a moving dot (which way?)",
    )
    synth.add_argument("--n-train", type=int, default=2048)
    synth.add_argument("--n-val", type=int, default=128)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="pixels, a multiple of 28 (default: 56; geometry 224; recolor and motion 112)",
    )
    synth.add_argument(
        "--force",
        action="store_true",
        help="write into a folder that is not empty (files of the same names are replaced)",
    )
    synth.set_defaults(func=_synth)
    return parser


def _resume_hint(args: argparse.Namespace) -> str:
    """How `mmrl train` goes on after it was interrupted: the same command with --resume. Other commands
    (the quickstart too) start over when run again."""
    if args.command != "train":
        return ""
    return f" To go on: {shlex.join(['mmrl', 'train', args.config, *args.overrides, '--resume'])}"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(word.startswith("-") for word in extra):
        args.overrides = [*args.overrides, *extra]  # `mmrl train CONFIG a=1 --resume b=2`: all are overrides
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ConfigError, EnvOptionError, FileNotFoundError, FileExistsError) as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        return 2
    except RunInterrupted as err:  # SIGTERM or Ctrl-C, after a checkpoint was saved
        Console(stderr=True).print(f"{err}{_resume_hint(args)}", highlight=False, soft_wrap=True)
        return err.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the training loop: stopped at once
        kept = "; checkpoints up to the last save are intact." if args.command == "train" else "."
        print(f"interrupted{kept}{_resume_hint(args)}", file=sys.stderr)
        return 130
    except RunStopped as err:  # an engine failure, a full disk, diverged gradients
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        return 1
    except OSError as err:
        if err.errno not in DISK_FULL:
            raise
        where = f" while writing {err.filename}" if err.filename else ""
        Console(stderr=True).print(
            f"[bold red]error:[/] no space left on the device{where}; free some space, then run the command "
            f"again{' with --resume (checkpoints written so far are intact)' if args.command == 'train' else ''}",
            highlight=False,
            soft_wrap=True,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
