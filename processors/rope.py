"""Qwen2.5-VL multimodal rotary position ids (mRoPE), computed without the model.

Text tokens advance all three axes (temporal, height, width) together. An image's or video's
tokens take a (t, h, w) grid offset by the running position; a video's temporal axis is spaced by
`second_per_grid_ts * tokens_per_second` (truncated to integers), so the same clip sampled at
different rates keeps positions proportional to real time. Padding (attention_mask == 0) gets 0
and is skipped.

The two rollout engines lay videos out differently, so each rule is here (`PositionRule`):

- transformers 5.19 (`get_rope_index`, and so the HF engine): a video's time ids are truncated
  from float32 arithmetic; the text after an image or video resumes max(h, w) / merge positions
  after the block's start, whatever its time axis reached; generated tokens continue after the
  last prompt token.
- vLLM 0.32 (its Qwen2.5-VL `get_mrope_input_positions`): time ids are
  truncated from float64 arithmetic on `second_per_grid_ts` already cast to the model dtype; every
  text run starts at 1 + the largest id so far on any axis, time axis included, and generated
  tokens at 1 + the prompt's largest id.

Images and short videos get the same ids either way. The text after a video parts once the
video's time ids outrun its spatial grid (4 frames at 2 fps, tokens_per_second 2, a 2x2 merged
grid: time ids 0 and 2, so transformers resumes at +2 and vLLM at +3); the time ids themselves
part for some frame rates (2.4 fps: step 5/3, and float32 rounds 3 x 5/3 up to 5, float64 down to
4.999...). Tested against the model's `get_rope_index` (tests/test_video.py) and vLLM's own
function (tests/test_vllm.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class PositionRule:
    """Which engine's mRoPE layout a row was sampled under.

    Training must compute a response's log-probs at the positions its tokens were sampled at: a
    token sampled by vLLM at position p and trained at position q is trained as the answer to a
    different input, so the PPO ratio and the KL are of the wrong distribution (the gap shows as
    `actor/rollout_logprob_diff`). vLLM's layout cannot be changed without patching vLLM, so each
    engine records its rule on the batch it returns and the trainer follows it.

    `seconds_dtype` is the precision of a video's seconds per temporal patch when the ids are
    computed: vLLM casts the processor's float outputs to the model dtype first, then scales in
    float64; transformers scales the float32 value in float32.
    """

    engine: Literal["transformers", "vllm"] = "transformers"
    seconds_dtype: torch.dtype = torch.float32


TRANSFORMERS_RULE = PositionRule()


def mrope_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    tokens_per_second: float = 1.0,
    rules: PositionRule | Sequence[PositionRule] = TRANSFORMERS_RULE,
) -> torch.Tensor:
    """Position ids of shape (3, B, L) for a padded batch; grids are listed in batch order, and
    `rules` is one rule for all rows or one per row."""
    batch, length = input_ids.shape
    row_rules = [rules] * batch if isinstance(rules, PositionRule) else list(rules)
    if len(row_rules) != batch:
        raise ValueError(f"{len(row_rules)} position rules for {batch} rows")
    ids = input_ids.cpu()
    valid = attention_mask.cpu().bool()
    # A text token's id is its place among its row's tokens, shifted by every media block before it:
    # `shift` holds each block's advance minus its length, at its last token.
    place = valid.long().cumsum(1) - 1
    shift = torch.zeros(batch * length, dtype=torch.long)
    blocks = []
    media = ((image_token_id, image_grid_thw, None), (video_token_id, video_grid_thw, second_per_grid_ts))
    for token, grid_thw, seconds in media:
        flat = torch.nonzero(((ids == token) & valid).flatten()).flatten()  # in batch order, as the grids
        if not len(flat):
            continue
        grid = grid_thw.cpu().long() if grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
        t, gh, gw = grid[:, 0], grid[:, 1] // spatial_merge_size, grid[:, 2] // spatial_merge_size
        ends = (t * gh * gw).cumsum(0)
        used = int((ends < len(flat)).sum()) + 1  # grids past the last placeholder are not this batch's
        if used > len(grid) or int(ends[used - 1]) != len(flat):
            raise ValueError(f"{len(flat)} placeholder tokens {token} do not fit the grids {grid.tolist()}")
        t, gh, gw, ends = t[:used], gh[:used], gw[:used], ends[:used]
        sizes = t * gh * gw
        starts = ends - sizes
        if not torch.equal(flat[ends - 1] - flat[starts], sizes - 1):
            raise ValueError(
                f"a grid's placeholder tokens {token} are not one run: the grids do not fit the prompt"
            )
        owner = torch.searchsorted(ends, torch.arange(len(flat)), right=True)  # each token's block
        offset = torch.arange(len(flat)) - starts[owner]
        area = gh * gw
        steps, hh, ww = offset // area[owner], offset % area[owner] // gw[owner], offset % gw[owner]
        rows = flat[starts] // length
        if token == video_token_id:
            times = _time_table(t, seconds, tokens_per_second, [row_rules[r] for r in rows.tolist()])
            steps = times[owner, steps]
            top = times.gather(1, (t - 1)[:, None]).flatten()
        else:
            top = t - 1
        vllm = torch.tensor([row_rules[r].engine == "vllm" for r in rows.tolist()])
        advance = torch.where(vllm, torch.maximum(top, torch.maximum(gh, gw) - 1) + 1, torch.maximum(gh, gw))
        shift[flat[ends - 1]] += advance - sizes
        blocks.append((flat, flat[starts][owner], torch.stack([steps, hh, ww])))
    shift = shift.view(batch, length)
    text = (place + shift.cumsum(1) - shift).flatten()
    positions = text.expand(3, -1).clone()
    for flat, first, grid_ids in blocks:
        positions[:, flat] = grid_ids + text[first]
    positions = positions.view(3, batch, length)
    positions[:, ~valid] = 0
    return positions.to(input_ids.device)


def _time_table(
    frames: torch.Tensor, seconds: torch.Tensor | None, tokens_per_second: float, rules: list[PositionRule]
) -> torch.Tensor:
    """(videos, most frames) temporal ids, each video's truncated as its row's rule truncates them."""
    # Videos without timing metadata default to one second per temporal grid, as the model does.
    # The step keeps the caller's dtype so truncation rounds exactly as in the model.
    seconds = seconds.cpu() if seconds is not None else torch.ones(len(frames))
    steps = torch.arange(int(frames.max()))[None]
    ours = (steps * (tokens_per_second * seconds)[:, None]).long()
    factors = [float(s.to(r.seconds_dtype)) * tokens_per_second for s, r in zip(seconds, rules, strict=True)]
    theirs = (steps.double() * torch.tensor(factors, dtype=torch.float64)[:, None]).long()
    return torch.where(torch.tensor([r.engine == "vllm" for r in rules])[:, None], theirs, ours)
