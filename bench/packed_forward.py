"""The actor's log-prob forward and backward on one micro-batch, by layout: padded or packed, each prompt
computed once per group or once per response.

The update's work at `vs_trl.py`'s realistic shape (a random-init Qwen2.5-VL of 108.6 M parameters, 448 px
images: 256 visual tokens; 2 prompts x n=8 responses in one micro-batch), without sampling: the responses
are random ordinary tokens of lengths set by `--lengths` (`cap`: all `--max-len` long, as most of
`vs_trl.py`'s realistic responses are; `spread`: uniform from 8 to `--max-len`). Layouts alternate, each
timed `--repeats` times after one untimed run; the table gives the median and the speed against padded-shared
(mmrl's padded layout; `actor.padding_free: auto` packs from 256 wide, `mmrl.training.packing`).

    .venv/bin/python bench/packed_forward.py --threads 1 --lengths spread --out /tmp/packed_forward.json
    .venv/bin/python bench/packed_forward.py --model tiny --image-size 112 --groups 8 --n 4 --max-len 8

`--model tiny` is the quickstart's 0.7 M-parameter model, where per-call overhead, not compute, decides.
`--text-width` sets the realistic model's language-model width (where `auto` starts packing):

    .venv/bin/python bench/packed_forward.py --threads 1 --text-width 256 --image-size 112 --groups 8 --n 4 \
        --max-len 8 --repeats 5 --layouts padded-shared,packed-shared
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, write_result
from vs_trl import REALISTIC_TEXT, REALISTIC_VISION

from mmrl.data.batch import Batch
from mmrl.data.dataset import with_pixels
from mmrl.data.sample import PromptSample
from mmrl.models import build_tiny, load_policy, load_processor
from mmrl.processors import PixelBudget, build_messages, encode_prompt, fit_image, num_image_tokens
from mmrl.training import forward
from mmrl.training.forward import forward_logprobs

# layout -> (padding_free, what the forward is patched with). padded: every response with its own copy of
# its prompt; padded-shared: mmrl's padded layout, each prompt once per group through a cache; packed-mask: rows
# packed whole under transformers' own packed attention (a dense mask on CPU); packed: rows packed whole,
# attention by segment; packed-shared: each prompt packed once before its responses, attention by segment.
LAYOUTS: dict[str, tuple[bool, Callable[[Any], AbstractContextManager]]] = {
    "padded": (
        False,
        lambda model: mock.patch.object(forward, "shared_prompts", return_value=None),
    ),
    "padded-shared": (False, lambda model: nullcontext()),
    "packed-mask": (
        True,
        lambda model: mock.patch.object(type(model), "is_gradient_checkpointing", property(lambda _: True)),
    ),
    "packed": (
        True,
        lambda model: mock.patch.object(forward, "shared_prompts", return_value=None),
    ),
    "packed-shared": (True, lambda model: nullcontext()),
}
DEFAULT = "padded-shared"


def build_batch(folder: Path, image_size: int, groups: int, n: int, lengths: str, max_len: int) -> Batch:
    """`groups` image prompts with `n` random responses each, as the trainer's rollout batch holds them."""
    processor = load_processor(folder)
    budget = PixelBudget(min_pixels=image_size**2, max_pixels=image_size**2, patch_size=14, merge_size=2)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(groups):
        pixels = torch.randint(0, 256, (image_size, image_size, 3), generator=gen, dtype=torch.uint8)
        image = fit_image(Image.fromarray(pixels.numpy()), budget)
        question = "<image>What colour is the shape? Answer in one word."
        ids = encode_prompt(
            processor.tokenizer,
            build_messages(question, 1),
            [num_image_tokens(image.height, image.width, budget)],
        )
        samples.append(
            with_pixels(
                PromptSample(i, ids, question, "red", images=[image]), [], processor.image_processor, None
            )
        )
    rows = [i for i in range(groups) for _ in range(n)]
    if lengths == "cap":
        sizes = torch.full((len(rows),), max_len)
    else:
        sizes = torch.randint(8, max_len + 1, (len(rows),), generator=gen)
    response = torch.randint(100, 900, (len(rows), max_len), generator=gen)
    mask = (torch.arange(max_len)[None] < sizes[:, None]).long()
    return Batch(
        tensors={"prompt_index": torch.tensor(rows), "response_ids": response * mask, "response_mask": mask},
        prompts=samples,
    )


def time_layout(model: Any, batch: Batch, pad_id: int, layout: str) -> float:
    """Seconds of one log-prob forward and the backward of their sum."""
    padding_free, patch = LAYOUTS[layout]
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with patch(model):
        logp, _ = forward_logprobs(model, batch, pad_id, padding_free=padding_free)
    (logp * batch["response_mask"]).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", choices=("cap", "spread"), default="spread")
    parser.add_argument("--max-len", type=int, default=256, help="the longest response")
    parser.add_argument("--groups", type=int, default=2, help="prompts in the micro-batch")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument(
        "--model", choices=("realistic", "tiny"), default="realistic", help="tiny: the quickstart's model"
    )
    parser.add_argument(
        "--text-width", type=int, help="realistic model: its language model this wide (heads of 64, MLP 4x)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from the table's rows")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layouts = args.layouts.split(",")
    with tempfile.TemporaryDirectory(prefix="mmrl-packed-") as tmp:
        folder = Path(tmp) / "model"
        sizes = {"text": REALISTIC_TEXT, "vision": REALISTIC_VISION} if args.model == "realistic" else {}
        if args.text_width and args.model == "realistic":
            width = args.text_width
            sizes = {
                "text": REALISTIC_TEXT
                | {"hidden_size": width, "intermediate_size": 4 * width}
                | {"num_attention_heads": width // 64},
                "vision": REALISTIC_VISION | {"out_hidden_size": width},
            }
        build_tiny(folder, max_pixels=args.image_size**2, **sizes)
        model = load_policy(folder).train()
        pad_id = load_processor(folder).tokenizer.pad_token_id
        batch = build_batch(folder, args.image_size, args.groups, args.n, args.lengths, args.max_len)
    for layout in layouts:  # one untimed run each: first-call allocations and kernel choice
        time_layout(model, batch, pad_id, layout)
    seconds: dict[str, list[float]] = {layout: [] for layout in layouts}
    for _ in range(args.repeats):
        for layout in layouts:
            seconds[layout].append(time_layout(model, batch, pad_id, layout))
    tokens = int(batch["response_mask"].sum())
    print(
        f"{args.groups} prompts x n={args.n}, {tokens} response tokens ({args.lengths}), {torch.get_num_threads()} threads"
    )
    print(f"{'layout':<16}{'seconds':>9}{'speed vs padded-shared':>24}")
    base = median(seconds[DEFAULT]) if DEFAULT in seconds else None
    for layout in layouts:
        s = median(seconds[layout])
        print(f"{layout:<16}{s:>9.2f}{(base / s if base else float('nan')):>23.2f}x")
    write_result(
        args.out, {"machine": machine(), "args": vars(args) | {"out": str(args.out)}, "seconds": seconds}
    )


if __name__ == "__main__":
    main()
