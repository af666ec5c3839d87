"""Videos through the whole loop: data rows with mp4 clips, the HF engine, the trainer's log-probs and
an update, mixed in one batch with image and text-only prompts; broken videos are skipped and counted."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import mixed_media_dataset, update_once

from mmrl.config import load_config
from mmrl.data.synthetic_video import QUESTION, generate_video
from mmrl.models import load_policy, load_processor
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.sources.prompts import build_datasets
from mmrl.training.forward import forward_logprobs


@pytest.fixture
def mixed(tmp_path, tiny_model_dir):
    processor = load_processor(tiny_model_dir)
    model = load_policy(tiny_model_dir)
    cfg, train = mixed_media_dataset(tmp_path, tiny_model_dir, processor, model.config)
    return cfg, model, processor, train


def test_broken_videos_are_skipped_and_counted(mixed) -> None:
    _, _, _, train = mixed
    samples = train.prepare_all()
    assert len(samples) == 4
    assert train.skipped == {"bad_video": 3}
    kinds = [(s.pixel_values is not None, s.pixel_values_videos is not None) for s in samples]
    assert kinds == [(True, False), (False, True), (True, True), (False, False)]
    # 4 frames sized up to the recipe's 112 px: 2 temporal patches of 8 x 8 vision patches
    assert samples[1].video_grid_thw.tolist() == [[2, 8, 8]]


def test_a_mixed_batch_rolls_out_scores_and_updates(mixed) -> None:
    """The trainer's log-probs of what the HF engine sampled equal the engine's own, row by row: same
    video features, same mRoPE ids (time axis included), same response positions after a video."""
    cfg, model, processor, train = mixed
    prompts = train.prepare_all()
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, logprobs=True)
    )
    pad = processor.tokenizer.pad_token_id
    with torch.no_grad():
        ours, _ = forward_logprobs(model.eval(), batch, pad)
    mask = batch["response_mask"].bool()
    gap = (ours - batch["rollout_logprobs"]).abs()[mask]
    assert float(gap.max()) < 1e-4, f"trainer and engine disagree by {float(gap.max()):.2e}"

    update_once(cfg, model, batch, pad, horizon=6)


def test_responses_after_a_long_video_continue_where_generation_put_them(tmp_path, tiny_model_dir) -> None:
    """16 frames end the prompt: the video's time axis (ids up to 14) runs past the few chat tokens
    after it. transformers' generation still continues after the last prompt token (not at 1 + the
    largest id, as vLLM would); the trainer places the response there too, or its log-probs would be
    of another sequence."""
    generate_video(tmp_path / "vid", n_train=2, n_val=0, seed=0, image_size=56, frames=16, task="motion")
    row = {"problem": f"{QUESTION}<video>", "answer": "left", "videos": ["vid/videos/train_000000.mp4"]}
    (tmp_path / "long.jsonl").write_text(json.dumps(row) + "\n")
    overrides = [
        f"model.path={tiny_model_dir}",
        f"data.train_files={tmp_path / 'long.jsonl'}",
        "data.val_files=[]",
        "data.video_max_frames=16",
        "data.video_max_total_pixels=200704",
        "data.max_prompt_length=256",
    ]
    cfg = load_config("configs/quickstart_video.yaml", overrides)
    processor, model = load_processor(tiny_model_dir), load_policy(tiny_model_dir).eval()
    prompts = build_datasets(cfg, processor, model.config)[0].prepare_all()
    assert prompts[0].video_grid_thw.tolist() == [[8, 8, 8]]
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, logprobs=True)
    )
    with torch.no_grad():
        ours, _ = forward_logprobs(model, batch, processor.tokenizer.pad_token_id)
    gap = (ours - batch["rollout_logprobs"]).abs()[batch["response_mask"].bool()]
    assert float(gap.max()) < 1e-4, f"trainer and engine disagree by {float(gap.max()):.2e}"
