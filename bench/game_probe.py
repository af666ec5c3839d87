"""Can the tiny policy read a game's frame for a good move at all? A supervised probe.

Before asking RL to find a move from reward alone, this asks the easier question: with the answer
given (a shortest-path move at every state), how fast does the tiny random-init Qwen2.5-VL learn to
name a good move from one gridnav frame, and how much does the observation matter (frame size, so
visual tokens per cell; the decoy, which makes the instruction matter)? States are the starts of
seeded episodes and the states a random walk reaches from them. Accuracy is greedy over the four move
words on held-out seeds: a move counts if it is on some shortest path. Prints a table.

    python bench/game_probe.py --variant 56=image_size=56 --variant 140=image_size=140 \\
        --variant 56-nodecoy=image_size=56,decoy=false
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, write_result

sys.path.insert(0, str(REPO))  # the envs package, not bench/envs.py

from mmrl.agent.game import PROMPT
from mmrl.data.batch import Batch, right_pad
from mmrl.data.dataset import with_pixels
from mmrl.data.sample import PromptSample
from mmrl.envs.gridnav import MOVES, GridNavEnv
from mmrl.models import build_tiny, load_policy, load_processor
from mmrl.processors import PixelBudget, build_messages, encode_prompt, num_image_tokens
from mmrl.training.forward import forward_logprobs
from mmrl.training.supervised import supervised_batch_step

BASE = {"size": 3, "walls": 0, "max_steps": 6, "view": "agent", "image_size": 56}


def states(
    options: dict[str, Any], seeds: range, rng: np.random.Generator
) -> list[tuple[np.ndarray, str, set[str]]]:
    """(frame, instruction, good moves) at each seed's start and after 0-3 random moves from it."""
    out = []
    env = GridNavEnv(**options)
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        for _ in range(int(rng.integers(0, 4))):
            obs, _, terminated, truncated, _ = env.step(env.words[str(rng.choice(list(MOVES)))])
            if terminated or truncated:
                obs, _ = env.reset(seed=seed)
                break
        distances = env.distances()
        here = distances[env.agent]
        good = {
            m
            for m, (dr, dc) in MOVES.items()
            if env.passable((env.agent[0] + dr, env.agent[1] + dc))
            and distances[(env.agent[0] + dr, env.agent[1] + dc)] < here
        }
        out.append((obs["image"], obs["instruction"], good))
    return out


def prompts(processor: Any, found: list[tuple[np.ndarray, str, set[str]]], size: int) -> list[PromptSample]:
    from PIL import Image

    budget = PixelBudget(size * size, size * size)
    samples = []
    for i, (frame, instruction, _) in enumerate(found):
        text = PROMPT.format(instruction=instruction, moves=", ".join(MOVES))
        ids = encode_prompt(
            processor.tokenizer, build_messages(text, 1), [num_image_tokens(size, size, budget)]
        )
        sample = PromptSample(i, ids, text, "", images=[Image.fromarray(frame)])
        samples.append(with_pixels(sample, [], processor.image_processor, None))
    return samples


def accuracy(model: Any, samples: list[PromptSample], found: list, words: list[list[int]], pad: int) -> float:
    """Share of held-out states whose most likely move word is a good move."""
    scores = []
    for word in words:
        response, mask = right_pad([word] * len(samples), pad)
        batch = Batch(
            tensors={
                "prompt_index": torch.arange(len(samples)),
                "response_ids": response,
                "response_mask": mask,
            },
            prompts=samples,
        )
        model.eval()
        with torch.no_grad():
            scores.append(forward_logprobs(model, batch, pad)[0].sum(1))
    best = torch.stack(scores, 1).argmax(1).tolist()
    names = list(MOVES)
    return float(np.mean([names[b] in good for b, (_, _, good) in zip(best, found, strict=True)]))


def run(name: str, options: dict[str, Any], args: argparse.Namespace, root: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    size = options["image_size"]
    folder = build_tiny(root / name, seed=0, min_pixels=size * size, max_pixels=size * size)
    model, processor = load_policy(folder), load_processor(folder)
    pad = processor.tokenizer.pad_token_id
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    words = [processor.tokenizer(m)["input_ids"] + [end] for m in MOVES]
    train = states(options, range(args.train_seeds), rng)
    held = states(options, range(1_000_000, 1_000_000 + args.val_seeds), rng)
    train_samples, held_samples = prompts(processor, train, size), prompts(processor, held, size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    curve, start = [(0, accuracy(model, held_samples, held, words, pad))], time.perf_counter()
    names = list(MOVES)
    for step in range(1, args.steps + 1):
        rows = rng.integers(0, len(train), args.batch).tolist()
        targets = [words[names.index(sorted(train[r][2])[0])] for r in rows]
        response, mask = right_pad(targets, pad)
        batch = Batch(
            tensors={"prompt_index": torch.as_tensor(rows), "response_ids": response, "response_mask": mask},
            prompts=train_samples,
        )
        loss = supervised_batch_step(model, optimizer, batch, pad, max_grad_norm=1.0)
        if step % args.eval_every == 0:
            curve.append((step, accuracy(model, held_samples, held, words, pad)))
            print(f"{name} step {step} loss {loss:.3f} held-out {curve[-1][1]:.2f}", flush=True)
    return {"variant": name, "options": options, "curve": curve, "s": round(time.perf_counter() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", action="append", required=True, help="NAME=option=value,...")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--train-seeds", type=int, default=2000)
    parser.add_argument("--val-seeds", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="game_probe_"))
    rows = []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        options = {
            **BASE,
            **{k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in rest.split(",") if o)},
        }
        rows.append(run(name, options, args, root))
    print(
        f"\ngridnav, a shortest-path move from one frame; greedy accuracy on {args.val_seeds} held-out states"
    )
    for r in rows:
        curve = " ".join(f"{s}:{a:.2f}" for s, a in r["curve"])
        print(f"{r['variant']:<14} {r['s']:>5} s  {curve}")
    write_result(args.out, {"machine": machine(), "args": vars(args) | {"out": str(args.out)}, "rows": rows})


if __name__ == "__main__":
    main()
