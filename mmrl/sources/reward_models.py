"""Model-based rewards: a learned reward model, and a generative judge asked through a rollout engine.

Both score a whole batch at once (one forward pass per micro-batch, not per sample) and re-encode
each sample for their own tokenizer, so the reward model need not share the policy's vocabulary or
chat template. The images they see are the ones the policy saw (`RewardInput.images`).
"""

from __future__ import annotations

import re
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.models import autocast_for, load_policy, load_processor
from mmrl.processors import build_messages, encode_prompt, pixel_inputs
from mmrl.rewards.graders import register_grader
from mmrl.rewards.types import RewardInput
from mmrl.rollout import SamplingParams, make_engine
from mmrl.training.critic import ValueModel
from mmrl.training.forward import response_hidden

REWARD_HEAD = "reward_head.safetensors"


def init_vision_reward_model(base: str | Path, out: str | Path, seed: int = 0) -> Path:
    """A vision reward model to train or to test with: a copy of the Qwen2.5-VL checkpoint `base`
    (weights, tokenizer, processor) plus a freshly initialised scalar head."""
    base, out = Path(base), Path(out)
    shutil.copytree(base, out)
    hidden = load_policy(base).config.get_text_config().hidden_size
    generator = torch.Generator().manual_seed(seed)
    head = {
        "weight": torch.randn(1, hidden, generator=generator) / hidden**0.5,
        "bias": torch.zeros(1),
    }
    save_file(head, out / REWARD_HEAD)
    return out


def prompt_sample(sample: RewardInput, text: str, processor: Any) -> PromptSample:
    """`text` and the sample's images encoded for `processor`'s model, ready for `response_hidden`
    or a rollout engine. The images are already sized in multiples of the patch grid, so the token
    count follows from their grid without resizing."""
    images = sample.images
    grid = pixel = None
    counts: list[int] = []
    if images:
        inputs = pixel_inputs(images, processor.image_processor)
        pixel, grid = inputs["pixel_values"], inputs["image_grid_thw"]
        merge = processor.image_processor.merge_size
        counts = [int(g.prod()) // merge**2 for g in grid]
    ids = encode_prompt(processor.tokenizer, build_messages(text, len(images)), counts)
    return PromptSample(0, ids, text, sample.ground_truth, images, [], pixel, grid)


class VisionRewardModel:
    """A Qwen2.5-VL reward model: the trunk reads the prompt, its images and the response; a linear
    head on the state after the response's last token gives the score (Ouyang et al. 2022)."""

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 16, max_length: int = 4096):
        path = Path(path)
        if not (path / REWARD_HEAD).is_file():
            raise FileNotFoundError(
                f"{path} has no {REWARD_HEAD}: it is not an mmrl vision reward model. Text reward models "
                "(AutoModelForSequenceClassification) load with TextRewardModel."
            )
        self.model = ValueModel(load_policy(path, torch.float32, device)).eval()
        self.model.value_head.load_state_dict(load_file(path / REWARD_HEAD))
        self.processor = load_processor(path)
        self.batch_size = batch_size
        self.max_length = max_length

    @torch.no_grad()
    def __call__(self, samples: list[RewardInput]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(samples), self.batch_size):
            scores += self._score(samples[start : start + self.batch_size])
        return scores

    def _score(self, samples: list[RewardInput]) -> list[float]:
        tok = self.processor.tokenizer
        prompts = [prompt_sample(s, s.prompt, self.processor) for s in samples]
        # The response ends with end-of-turn, and the score is read at the position predicting it:
        # the state after the whole response.
        responses = [
            tok(s.response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for s in samples
        ]
        responses = [
            r[-max(1, self.max_length - len(p.prompt_ids)) :] for r, p in zip(responses, prompts, strict=True)
        ]
        width = max(map(len, responses))
        ids = torch.full((len(samples), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(responses):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        batch = Batch(
            tensors={"prompt_index": torch.arange(len(samples)), "response_ids": ids, "response_mask": mask},
            prompts=prompts,
        )
        with autocast_for(self.model, torch.float32):
            hidden = response_hidden(self.model, batch, tok.pad_token_id)
        last = mask.sum(dim=1) - 1
        values = self.model.value_head(hidden[torch.arange(len(samples)), last]).squeeze(-1)
        return values.float().cpu().tolist()


class TextRewardModel:
    """Any transformers sequence-classification model with one label, over the chat-formatted text
    (prompt, response). It does not see images: use it for text-only judgements such as style."""

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 16, max_length: int = 4096):
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"{path} has num_labels={self.model.config.num_labels}; a reward model outputs one score "
                "(num_labels=1)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"
        self.batch_size = batch_size
        self.max_length = max_length

    @torch.no_grad()
    def __call__(self, samples: list[RewardInput]) -> list[float]:
        texts = [
            self.tokenizer.apply_chat_template(
                [
                    {"role": "user", "content": s.prompt.replace("<image>", "")},
                    {"role": "assistant", "content": s.response},
                ],
                tokenize=False,
            )
            for s in samples
        ]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(device)
            scores += self.model(**enc).logits[:, 0].float().cpu().tolist()
        return scores


DEFAULT_JUDGE_TEMPLATE = (
    "{prompt}\n\nA student answered:\n{response}\n\nThe reference answer is: {ground_truth}\n"
    "Is the student's answer correct? Reply with yes or no."
)


def parse_verdict(text: str) -> float | None:
    """A judge's reply as a score: yes/no (or correct/incorrect) as 1/0, else the first number in
    [0, 1] (e.g. "Score: 0.7"); None when the reply says neither, which the caller counts."""
    lowered = text.strip().lower()
    if re.match(r"^\W*(yes|correct)\b", lowered):
        return 1.0
    if re.match(r"^\W*(no|incorrect|wrong)\b", lowered):
        return 0.0
    number = re.search(r"(?<![\d.])(0(?:\.\d+)?|1(?:\.0+)?)(?![\d.])", lowered)
    return float(number.group(1)) if number else None


class GenerativeJudge:
    """A VLM asked, through a rollout engine, whether each response is right; greedy, one answer each.

    The template is rendered with `{prompt}` (with its `<image>` markers: the judge sees the same
    images), `{response}` and `{ground_truth}`. Replies that parse to no verdict score 0 and are
    counted in `unparsed`, so a judge that rambles shows up in the metrics instead of as noise."""

    def __init__(
        self,
        path: str | Path,
        template: str = DEFAULT_JUDGE_TEMPLATE,
        engine: str = "hf",
        device: str = "cpu",
        max_new_tokens: int = 16,
        batch_size: int = 16,
    ):
        self.processor = load_processor(path)
        model = load_policy(path, torch.float32, device)
        self.engine = make_engine(engine, model, self.processor, torch.float32, model_path=path)
        self.template = template
        self.params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
        self.batch_size = batch_size
        self.unparsed = 0

    def __call__(self, samples: list[RewardInput]) -> list[dict[str, float]]:
        replies: list[str] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            prompts = [prompt_sample(s, self.render(s), self.processor) for s in chunk]
            replies += self.engine.generate(prompts, self.params)["response_text"]
        scores = []
        for reply in replies:
            verdict = parse_verdict(reply)
            self.unparsed += verdict is None
            scores.append({"overall": verdict or 0.0, "parsed": float(verdict is not None)})
        return scores

    def render(self, sample: RewardInput) -> str:
        return self.template.format(
            prompt=sample.prompt, response=sample.response, ground_truth=sample.ground_truth
        )


def _device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


@lru_cache(maxsize=4)
def _reward_model(
    path: str, device: str, batch_size: int, max_length: int
) -> VisionRewardModel | TextRewardModel:
    """Loaded once per run and config, not once per batch."""
    if (Path(path) / REWARD_HEAD).is_file():
        return VisionRewardModel(path, device, batch_size, max_length)
    return TextRewardModel(path, device, batch_size, max_length)


@lru_cache(maxsize=4)
def _judge(
    path: str, template: str, engine: str, device: str, max_new_tokens: int, batch_size: int
) -> GenerativeJudge:
    return GenerativeJudge(path, template, engine, device, max_new_tokens, batch_size)


@register_grader("reward_model", batched=True)
def reward_model(
    samples: list[RewardInput], path: str, device: str = "auto", batch_size: int = 16, max_length: int = 4096
) -> list[float]:
    """A learned reward model's score. A folder with `reward_head.safetensors` is a vision reward model
    (it sees the images); any other is loaded as a text sequence-classification model."""
    return _reward_model(str(Path(path).resolve()), _device(device), batch_size, max_length)(samples)


@register_grader("llm_judge", batched=True)
def llm_judge(
    samples: list[RewardInput],
    path: str,
    template: str = DEFAULT_JUDGE_TEMPLATE,
    engine: str = "hf",
    device: str = "auto",
    max_new_tokens: int = 16,
    batch_size: int = 16,
) -> list[dict[str, float]]:
    """A VLM judge's verdict (1 yes, 0 no, or a score in [0, 1]), asked through a rollout engine; the
    `parsed` metric is the share of replies that gave a verdict."""
    judge = _judge(str(Path(path).resolve()), template, engine, _device(device), max_new_tokens, batch_size)
    return judge(samples)
