"""Videos through the whole loop: data rows with mp4 clips, the HF engine, the trainer's log-probs and
an update, mixed in one batch with image and text-only prompts; broken videos are skipped and counted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mmrl.actor import build_actor, forward_logprobs
from mmrl.config import load_config
from mmrl.models import load_policy, load_processor
from mmrl.optim import plan_minibatches
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.synthetic import generate
from mmrl.synthetic_video import QUESTION, generate_motion
from mmrl.trainer import build_datasets


def _mixed_rows(root: Path) -> Path:
    """Image, video, image+video and text-only rows, then three rows with broken videos."""
    generate(root / "img", task="color", n_train=2, n_val=0, seed=0, image_size=56)
    generate_motion(root / "vid", n_train=2, n_val=0, seed=0, image_size=56)
    image, video = "img/images/train_000000.png", "vid/videos/train_000000.mp4"
    shutil.copy(root / "vid/videos/train_000001.mp4", root / "truncated.mp4")
    data = (root / "truncated.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(data[: len(data) // 3])
    (root / "empty.mp4").write_bytes(b"")
    rows = [
        {"problem": "<image>What colour is the shape?", "answer": "red", "images": [image]},
        {"problem": f"<video>{QUESTION}", "answer": "left", "videos": [video]},
        {
            "problem": f"<image>colour? <video>{QUESTION}",
            "answer": "up",
            "images": [image],
            "videos": [video],
        },
        {"problem": "How many circles?", "answer": "one"},
        {"problem": f"<video>{QUESTION}", "answer": "left", "videos": ["truncated.mp4"]},
        {"problem": f"<video>{QUESTION}", "answer": "left", "videos": ["empty.mp4"]},
        {"problem": f"<video>{QUESTION}", "answer": "left", "videos": ["missing.mp4"]},
    ]
    path = root / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def mixed(tmp_path, tiny_model_dir):
    cfg = load_config(
        "configs/quickstart_video.yaml",
        [f"model.path={tiny_model_dir}", f"data.train_files={_mixed_rows(tmp_path)}", "data.val_files=[]"],
    )
    processor = load_processor(tiny_model_dir)
    model = load_policy(tiny_model_dir)
    train, _ = build_datasets(cfg, processor, model.config)
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

    scores = torch.arange(len(batch), dtype=torch.float32) % 3
    batch.set(advantages=(scores - scores.mean())[:, None].expand_as(batch["response_mask"]).clone())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    actor = build_actor(cfg, model, pad, torch.float32)
    stats = actor.update(batch, plan_minibatches(batch, len(batch), epochs=1, horizon=6))
    assert stats.skipped_steps == 0
    visual = [k for k in before if k.startswith("model.visual.")]
    assert any(not torch.equal(before[k], model.state_dict()[k]) for k in visual), (
        "the vision tower learned nothing"
    )


def test_responses_after_a_long_video_continue_where_generation_put_them(tmp_path, tiny_model_dir) -> None:
    """16 frames end the prompt: the video's time axis (ids up to 14) runs past the few chat tokens
    after it. transformers' generation still continues after the last prompt token (not at 1 + the
    largest id, as vLLM would); the trainer places the response there too, or its log-probs would be
    of another sequence."""
    generate_motion(tmp_path / "vid", n_train=2, n_val=0, seed=0, image_size=56, frames=16)
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
