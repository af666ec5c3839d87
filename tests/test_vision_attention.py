"""The vision towers' attention over their images and windows in one SDPA call per length
(`mmrl.models.vision_attention`) gives exactly what transformers' one call per image or window gives."""

from __future__ import annotations

import pytest
import torch

from mmrl.models import load_policy
from mmrl.models.vision_attention import VARLEN_SDPA

# Images of two sizes, so that both the one-length reshape (the windows of the 8x8 grids) and the
# gather by length (the 6x10 grid's partial windows, and both grids' full attention) run.
GRIDS = torch.tensor([[1, 8, 8]] * 5 + [[1, 6, 10]] * 2)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_stacked_vision_attention_equals_one_call_per_span(family: str, tiny_family_dir) -> None:
    model = load_policy(tiny_family_dir(family))
    vision = model.config.vision_config
    assert vision._attn_implementation == VARLEN_SDPA, "load_policy should route the tower through it"
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(int(GRIDS.prod(-1).sum()), width, generator=torch.Generator().manual_seed(0))
    results = []
    for implementation in ("sdpa", VARLEN_SDPA):
        vision._attn_implementation = implementation
        model.zero_grad()
        leaf = pixels.clone().requires_grad_()
        features = model.model.visual(leaf, grid_thw=GRIDS).pooler_output
        features.square().sum().backward()
        weight_grad = model.model.visual.blocks[0].attn.qkv.weight.grad.clone()
        results.append((features.detach(), leaf.grad, weight_grad))
    for ours, theirs in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
