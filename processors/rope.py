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

import itertools
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
    positions = torch.zeros(3, batch, length, dtype=torch.long)
    grids = {image_token_id: iter(image_grid_thw.tolist() if image_grid_thw is not None else [])}
    grids[video_token_id] = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
    # Videos without timing metadata default to one second per temporal grid, as the model does.
    # The step stays a tensor of the caller's dtype so truncation rounds exactly as in the model.
    seconds = (
        iter(second_per_grid_ts.cpu())
        if second_per_grid_ts is not None
        else itertools.repeat(torch.tensor(1.0))
    )
    ids_cpu = input_ids.cpu()
    mask_cpu = attention_mask.cpu().bool()
    vision_ids = {image_token_id, video_token_id}
    for b in range(batch):
        rule = row_rules[b]
        tokens = ids_cpu[b][mask_cpu[b]].tolist()  # plain ints: a loop over tensor elements is 100x slower
        pieces: list[torch.Tensor] = []
        cursor = 0
        # Runs of text tokens, and runs of one kind of placeholder token.
        for kind, run in itertools.groupby(tokens, key=lambda tok: tok if tok in vision_ids else None):
            size = sum(1 for _ in run)
            if kind is None:
                pieces.append(torch.arange(cursor, cursor + size).expand(3, -1))
                cursor += size
                continue
            # One run of identical placeholder tokens may hold several images back to back.
            while size > 0:
                t, h, w = next(grids[kind])
                gh, gw = h // spatial_merge_size, w // spatial_merge_size
                tt = torch.arange(t)
                if kind == video_token_id:
                    tt = _time_ids(tt, next(seconds), tokens_per_second, rule)
                grid = torch.stack(torch.meshgrid(tt, torch.arange(gh), torch.arange(gw), indexing="ij"))
                pieces.append(grid.reshape(3, -1) + cursor)
                cursor += max(gh, gw) if rule.engine == "transformers" else int(grid.max()) + 1
                size -= t * gh * gw
        if pieces:
            positions[:, b, mask_cpu[b]] = torch.cat(pieces, dim=1)
    return positions.to(input_ids.device)


def _time_ids(
    steps: torch.Tensor, seconds: torch.Tensor, tokens_per_second: float, rule: PositionRule
) -> torch.Tensor:
    """A video's temporal ids, truncated as the rule's engine truncates them."""
    if rule.engine == "transformers":
        return (steps * (tokens_per_second * seconds)).long()
    factor = float(seconds.to(rule.seconds_dtype)) * tokens_per_second
    return (steps.double() * factor).long()
