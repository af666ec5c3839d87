"""Qwen2.5-VL multimodal rotary position ids (mRoPE), computed without the model.

Text tokens advance all three axes (temporal, height, width) together. An image's or video's
tokens take a (t, h, w) grid offset by the running position, and the text after it resumes
max(h, w) / merge positions later, as transformers' `get_rope_index` does. A video's temporal
axis is spaced by `second_per_grid_ts * tokens_per_second` (truncated to integers), so the same
clip sampled at different rates keeps positions proportional to real time. Padding
(attention_mask == 0) gets 0 and is skipped. Tested against the model's own `get_rope_index`
for images, videos and both mixed, so the two can never drift apart.

Caveat for videos: vLLM (and transformers before 5.3) resume text at 1 + the largest id so far,
which differs from the rule above once a video's temporal ids outrun its max(h, w) grid.
transformers 5.19's generation continues after the last prompt token, as this rule does
(`tests/test_video_training.py`), so mmrl trains video prompts on the HF engine's positions, and
the vLLM engine refuses video prompts rather than train on log-probs of other positions.
"""

from __future__ import annotations

import itertools

import torch


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
) -> torch.Tensor:
    """Position ids of shape (3, B, L) for a padded batch; grids are listed in batch order."""
    batch, length = input_ids.shape
    positions = torch.zeros(3, batch, length, dtype=torch.long)
    grids = {image_token_id: iter(image_grid_thw.tolist() if image_grid_thw is not None else [])}
    grids[video_token_id] = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
    # Videos without timing metadata default to one second per temporal grid, as the model does.
    # The step stays a tensor of the caller's dtype so truncation rounds exactly as in the model.
    seconds = iter(second_per_grid_ts.cpu()) if second_per_grid_ts is not None else itertools.repeat(1.0)
    ids_cpu = input_ids.cpu()
    mask_cpu = attention_mask.cpu().bool()
    for b in range(batch):
        tokens = ids_cpu[b][mask_cpu[b]]
        is_vision = (tokens == image_token_id) | (tokens == video_token_id)
        pieces: list[torch.Tensor] = []
        cursor, start = 0, 0
        n = tokens.numel()
        while start < n:
            end = start
            vision = bool(is_vision[start])
            kind = int(tokens[start])
            while end < n and bool(is_vision[end]) == vision and (not vision or int(tokens[end]) == kind):
                end += 1
            if not vision:
                pieces.append(torch.arange(cursor, cursor + end - start).expand(3, -1))
                cursor += end - start
                start = end
                continue
            # One run of identical placeholder tokens may hold several images back to back.
            while start < end:
                t, h, w = next(grids[kind])
                gh, gw = h // spatial_merge_size, w // spatial_merge_size
                step = tokens_per_second * next(seconds) if kind == video_token_id else 1.0
                tt = (torch.arange(t) * step).long()
                grid = torch.stack(torch.meshgrid(tt, torch.arange(gh), torch.arange(gw), indexing="ij"))
                pieces.append(grid.reshape(3, -1) + cursor)
                cursor += max(gh, gw)
                start += t * gh * gw
        if pieces:
            positions[:, b, mask_cpu[b]] = torch.cat(pieces, dim=1)
    return positions.to(input_ids.device)
