"""Games: multi-turn episodes of an `envs/` task, in which each observation is the policy's next user turn.

The policy answers a frame with a move word (`Env.words`: "up", "left", ...), the env steps, and the new
frame with its instruction comes back as a user turn, until the episode ends (`done`), the env's own
step limit (`env_steps`) or an agent limit. The whole episode is one trajectory: the trainer scores all
of its moves in one forward over every frame, and GRPO compares the n episodes of one start.

Rows are episodes' first frames, written with their seeds by `write_game_rows`, so the prompt source's
loader and cursor, validation, the gallery, checkpoints and `mmrl eval` serve games unchanged. The
responder resets each trajectory's env from its row's `seed` and checks that it draws the row's frame.
The episode's outcome reaches rewards in `extra` (`env_return`, `env_success`; graders of those names).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmrl.agent.loop import Reply, Trajectory
from mmrl.agent.scripts import Script
from mmrl.envs.base import Env
from mmrl.envs.experts import expert_action
from mmrl.envs.registry import make_env
from mmrl.processors.chat import user_turn_text

GAME_OUTCOMES = ("env_return", "env_success", "env_steps", "env_invalid")  # each trajectory's `extra`
STATES = "env_states"  # in `extra`: the state each move was chosen in, for turn-level credit (GiGPO)
PROMPT = "<image>{instruction}. Answer with one move: {moves}."
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_move(text: str, words: dict[str, np.ndarray]) -> str | None:
    """The move a turn names: the `<answer>` block's text if there is one, else the whole turn, as one of
    `words` (case and surrounding punctuation aside); None if it names none."""
    match = _ANSWER.search(text)
    word = (match.group(1) if match else text).strip().strip(".!").strip().lower()
    return word if word in words else None


def game_env(task: str, options: dict[str, Any]) -> Env:
    """An env of `task` that a language policy can play: one that names its moves (`Env.words`)."""
    env = make_env(task, **options)
    if not env.words:
        env.close()
        raise ValueError(
            f"env {task!r} names no moves (`words`), so a language policy cannot play it turn by turn; "
            "train it as a VLA policy with action tokens instead (an `env` section, no `agent.game`)"
        )
    return env


def write_game_rows(
    out_dir: str | Path,
    task: str,
    options: dict[str, Any],
    splits: dict[str, list[int]],
    prompt: str = PROMPT,
) -> None:
    """`<split>.jsonl` for each split's seeds: a row per episode with its first frame, its seed and the
    prompt (`{instruction}` and `{moves}` filled in), in the layout `data.train_files` reads."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    env = game_env(task, options)
    moves = ", ".join(env.words)
    try:
        for split, seeds in splits.items():
            lines = []
            for seed in seeds:
                obs, _ = env.reset(seed=seed)
                rel = f"images/{split}_{seed}.png"
                Image.fromarray(obs["image"]).save(out / rel)
                text = prompt.format(instruction=obs["instruction"], moves=moves)
                row = {"problem": text, "answer": "success", "images": [rel], "seed": seed}
                lines.append(json.dumps(row) + "\n")
            (out / f"{split}.jsonl").write_text("".join(lines), encoding="utf-8")
    finally:
        env.close()


class ExpertScript(Script):
    """A warm-up trajectory whose {move}s are the task's scripted expert's (`mmrl.envs.experts`), with action
    noise: a behaviour-cloning start for a game. The script plays its own copy of the trajectory's env,
    which stays in step with the responder's: both start from the row's seed and take the same moves."""

    def __init__(self, turns: list[str], env: Env, rng: np.random.Generator, noise: float | None) -> None:
        super().__init__(turns)
        self.env, self.rng, self.noise = env, rng, noise

    def next(self) -> str:
        action = expert_action(self.env, self.rng, self.noise)
        move = min(self.env.words, key=lambda w: float(np.sum((self.env.words[w] - action) ** 2)))
        self.env.step(self.env.words[move])
        return super().next().replace("{move}", move)


def expert_scripts(
    responder: GameResponder,
    turns: list[str],
    seeds: list[int],
    rng: np.random.Generator,
    noise: float | None,
) -> list[ExpertScript]:
    """One expert script per seed, each on a fresh env of the responder's task."""
    out = []
    for seed in seeds:
        env = game_env(responder.task, responder.options)
        env.reset(seed=seed)
        out.append(ExpertScript(turns, env, rng, noise))
    return out


def state_key(obs: dict[str, Any]) -> str:
    """What the policy sees (frame and instruction) as a short digest: two turns that saw the same are
    decisions from one state, which is what GiGPO compares."""
    digest = hashlib.blake2b(np.ascontiguousarray(obs["image"]).tobytes(), digest_size=8)
    digest.update(str(obs.get("instruction", "")).encode())
    return digest.hexdigest()


class GameResponder:
    """Steps each trajectory's own env with the move its turn names (see the module). A turn that names
    no move is counted in `extra["env_invalid"]` and answered with what the moves are; the env does not
    step."""

    role = "user"

    def __init__(self, task: str, options: dict[str, Any]) -> None:
        self.task, self.options = task, options
        with game_env(task, options) as env:  # refuses a task without move words before the run starts
            self.moves = ", ".join(env.words)
        self._envs: dict[int, Env] = {}

    def begin(self, trajectories: list[Trajectory]) -> None:
        self.close()
        for t in trajectories:
            if "seed" not in t.prompt.extra:
                raise ValueError(
                    f"row {t.prompt.row_id} has no `seed` column: a game's rows are its episodes' first "
                    "frames with their seeds, as `write_game_rows` writes them"
                )
            env = game_env(self.task, self.options)
            obs, _ = env.reset(seed=int(t.prompt.extra["seed"]))
            shown = (t.prompt.originals or t.prompt.images)[0]
            if not np.array_equal(obs["image"], np.asarray(shown.convert("RGB"))):
                raise ValueError(
                    f"row {t.prompt.row_id}: env {self.task!r} with seed {t.prompt.extra['seed']} does not draw "
                    "the row's image; write the rows again with the run's `agent.game.options`"
                )
            self._envs[id(t)] = env
            t.outcome.update(dict.fromkeys(GAME_OUTCOMES, 0))
            t.outcome[STATES] = [state_key(obs)]

    def respond(self, trajectories: list[Trajectory], last: bool) -> list[Reply]:
        replies: list[Reply] = []
        for t in trajectories:
            env = self._envs[id(t)]
            move = parse_move(t.turns[-1].text, env.words)
            if move is None:
                t.outcome["env_invalid"] += 1
                if not last:
                    t.outcome[STATES].append(t.outcome[STATES][-1])  # the env did not step
                replies.append(
                    "max_turns" if last else [[f"That is not a move. Answer with one of: {self.moves}."]]
                )
                continue
            obs, reward, terminated, truncated, info = env.step(env.words[move])
            t.outcome["env_return"] += reward
            t.outcome["env_steps"] += 1
            t.outcome["env_success"] = float(info["success"])
            if terminated or truncated:
                replies.append("done" if terminated else "env_steps")
            elif last:
                replies.append("max_turns")
            else:
                t.outcome[STATES].append(state_key(obs))
                replies.append([[Image.fromarray(obs["image"]), obs["instruction"]]])
        return replies

    def turn_text(self, parts: list[str | None]) -> str:
        return user_turn_text(parts)

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()
