"""Prompt datasets: bad rows are skipped and counted by reason, batches are full, order is resumable."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from mmrl.config import DataConfig
from mmrl.data.dataset import PromptDataset, PromptInputs, read_rows
from mmrl.data.loaders import PromptLoader, StreamLoader, make_loader
from mmrl.data.prefetch import PrefetchLoader
from mmrl.errors import ConfigError
from mmrl.models import load_processor
from mmrl.processors import PixelBudget, num_image_tokens

# Exactly four 28x28 cells per image: 60x50 is resized to 56x56, 120x30 to 112x28; both 4 tokens.
BUDGET = PixelBudget(min_pixels=56 * 56, max_pixels=56 * 56)
TOKENS_PER_IMAGE = 4
FITTED = {(60, 50): (56, 56), (120, 30): (112, 28)}
MAX_PROMPT = 64
N_GOOD = 10


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Any:
    return load_processor(tiny_model_dir)


def _png(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (60, 50)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, format="PNG")
    return path.name


def _corpus(folder: Path) -> tuple[Path, dict[int, str], list[int]]:
    """A jsonl file of good and bad rows; returns it, {line index: expected skip reason}, good ids."""
    img = folder / "img"
    good_one = _png(img / "good.png", (200, 0, 0))
    good_two = _png(img / "good2.png", (0, 0, 200), size=(120, 30))
    _png(img / "full.png", (0, 150, 0), size=(64, 64))
    full = (img / "full.png").read_bytes()
    (img / "truncated.png").write_bytes(full[: len(full) // 2])
    (img / "empty.png").write_bytes(b"")

    lines: list[str] = []
    expected: dict[int, str] = {}
    good: list[int] = []

    def row(record: dict[str, Any] | str, reason: str | None = None) -> None:
        if reason is None:
            good.append(len(lines))
        else:
            expected[len(lines)] = reason
        lines.append(record if isinstance(record, str) else json.dumps(record))

    colours = ["red", "green", "blue", "yellow", "purple"]
    for i in range(N_GOOD - 2):
        row(
            {
                "problem": "<image>What colour is the shape?",
                "answer": colours[i % 5],
                "images": [f"img/{good_one}"],
            }
        )
        if i == 2:
            row(
                {"problem": "What colour is the shape?", "answer": "red", "images": "img/truncated.png"},
                "bad_image",
            )
        if i == 4:
            row({"problem": "What colour?", "answer": "red", "images": ["img/empty.png"]}, "bad_image")
            row("{not json", "bad_row")
    # Two images with two markers, and an image-free row with an integer answer.
    row(
        {
            "problem": "<image> or <image>: which is blue?",
            "answer": "two",
            "images": [f"img/{good_one}", f"img/{good_two}"],
        }
    )
    row({"problem": "How many sides has a square?", "answer": 4})
    row({"problem": "What colour?", "answer": "red", "images": ["img/does_not_exist.png"]}, "bad_image")
    row({"problem": "<image>What colour?", "images": [f"img/{good_one}"]}, "missing_answer")
    row({"problem": "<image>What colour?", "answer": None, "images": [f"img/{good_one}"]}, "missing_answer")
    row({"problem": 42, "answer": "red", "images": [f"img/{good_one}"]}, "missing_prompt")
    row({"answer": "red", "images": [f"img/{good_one}"]}, "missing_prompt")
    row(
        {
            "problem": "<image>" + " what colour is the shape" * 40,
            "answer": "red",
            "images": [f"img/{good_one}"],
        },
        "prompt_too_long",
    )
    row(
        {"problem": "<image> and <image>?", "answer": "red", "images": [f"img/{good_one}"]},
        "image_marker_mismatch",
    )
    row("[1, 2, 3]", "bad_row")
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, expected, good


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, dict[int, str], list[int]]:
    return _corpus(tmp_path)


def _inputs(processor: Any) -> PromptInputs:
    return PromptInputs(processor.tokenizer, processor.image_processor, BUDGET)


def _dataset(path: Path, processor: Any, max_prompt_length: int = MAX_PROMPT) -> PromptDataset:
    return PromptDataset(
        read_rows([str(path)]), DataConfig(max_prompt_length=max_prompt_length), _inputs(processor)
    )


def test_each_bad_row_is_skipped_with_its_reason(corpus, processor) -> None:
    path, expected, good = corpus
    dataset = _dataset(path, processor)
    assert len(dataset) == len(expected) + len(good)
    for index in range(len(dataset)):
        before = Counter(dataset.skipped)
        sample = dataset.prepare(index)
        if index in expected:
            assert sample is None, f"row {index} should be skipped as {expected[index]}"
            assert dataset.skipped - before == Counter({expected[index]: 1}), index
        else:
            assert sample is not None, f"row {index} is good but was skipped: {dataset.skipped - before}"
            assert sample.row_id == index
    assert dataset.skipped == Counter(expected.values())
    assert dataset.skipped == Counter(
        bad_image=3, missing_answer=2, missing_prompt=2, bad_row=2, prompt_too_long=1, image_marker_mismatch=1
    )


@pytest.mark.timeout(30)  # without the deadline it waits forever
def test_an_image_that_blocks_on_read_is_skipped_instead_of_waited_for(
    tmp_path, processor, monkeypatch, caplog
) -> None:
    """A FIFO as an image path (or a read from a hung network mount) blocked the data thread forever, and
    with it the step a SIGTERM waits to finish: it is refused at once, and a read past the deadline is
    given up, each row skipped and counted as bad_image with its reason logged."""
    from mmrl.processors import files

    _png(tmp_path / "good.png", (255, 0, 0))
    _png(tmp_path / "hung.png", (0, 255, 0))
    os.mkfifo(tmp_path / "fifo.png")
    path = tmp_path / "rows.jsonl"
    rows = [
        {"problem": "<image>colour?", "answer": "red", "images": [name]} for name in ("fifo.png", "hung.png")
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in [*rows, {**rows[0], "images": ["good.png"]}]))
    real = files._regular_size

    def hung_mount(file: Path) -> int:
        if file.name == "hung.png":
            time.sleep(5)
        return real(file)

    monkeypatch.setattr(files, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(files, "_regular_size", hung_mount)
    dataset = _dataset(path, processor)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mmrl"):
        assert [s.row_id for s in dataset.prepare_all()] == [2]
    assert time.monotonic() - start < 3
    assert dataset.bad_rows == {0: "bad_image", 1: "bad_image"}
    assert "fifo.png is a FIFO, not a regular file" in caplog.text


def test_prepare_all_keeps_only_good_rows(corpus, processor) -> None:
    path, expected, good = corpus
    dataset = _dataset(path, processor)
    samples = dataset.prepare_all()
    assert [s.row_id for s in samples] == good
    assert sum(dataset.skipped.values()) == len(expected)


def test_good_rows_have_one_placeholder_per_visual_token(corpus, processor, tiny_model_dir) -> None:
    path, _, good = corpus
    dataset = _dataset(path, processor)
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    seen_images = Counter()
    for index in good:
        sample = dataset.prepare(index)
        n_images = len(sample.images)
        seen_images[n_images] += 1
        assert sample.prompt_ids.count(pad_id) == TOKENS_PER_IMAGE * n_images
        assert sample.prompt_ids.count(pad_id) == sum(
            num_image_tokens(im.height, im.width, BUDGET) for im in sample.images
        )
        assert len(sample.prompt_ids) <= MAX_PROMPT
        if n_images:
            assert [im.size for im in sample.images] == [FITTED[s.original] for s in sample.image_sizes]
            assert all(
                s.model_input == im.size for s, im in zip(sample.image_sizes, sample.images, strict=True)
            )
            assert sample.image_grid_thw.shape == (n_images, 3)
            merged = sample.image_grid_thw.prod(dim=1) // (BUDGET.merge_size**2)
            assert merged.tolist() == [TOKENS_PER_IMAGE] * n_images
            assert sample.pixel_values.shape[0] == int(sample.image_grid_thw.prod(dim=1).sum())
        else:
            assert sample.pixel_values is None and sample.image_grid_thw is None
    assert seen_images == Counter({1: N_GOOD - 2, 2: 1, 0: 1})


def test_two_image_row_keeps_images_in_marker_order(corpus, processor) -> None:
    path, _, good = corpus
    dataset = _dataset(path, processor)
    sample = next(s for s in map(dataset.prepare, good) if len(s.images) == 2)
    assert [s.original for s in sample.image_sizes] == [(60, 50), (120, 30)]
    assert [s.model_input for s in sample.image_sizes] == [(56, 56), (112, 28)]
    assert sample.image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 8]]
    assert sample.ground_truth == "two"
    ids = sample.prompt_ids
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    start_id = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert ids.count(start_id) == 2
    text = processor.tokenizer.decode(ids)
    assert text.index("or") > text.index("<|image_pad|>")  # the words sit between the two images
    assert ids.count(pad_id) == 2 * TOKENS_PER_IMAGE


def _run(loader: PromptLoader, batches: int) -> list[list[int]]:
    out = []
    for _ in range(batches):
        batch = loader.next_batch()
        assert len(batch) == loader.batch_size
        out.append([s.row_id for s in batch])
    return out


def test_loader_batches_are_full_of_good_rows_and_epochs_roll_over(corpus, processor) -> None:
    path, expected, good = corpus
    dataset = _dataset(path, processor)
    loader = PromptLoader(dataset, batch_size=4, seed=3)
    first, second = _run(loader, 2)
    assert loader.epoch == 0  # 8 of the 10 good rows seen
    third = loader.next_batch()
    assert len(third) == 4
    assert loader.epoch == 1  # the last 2 good rows of epoch 0, then 2 from epoch 1
    epoch0 = first + second + [s.row_id for s in third[:2]]
    assert sorted(epoch0) == good  # every good row exactly once per epoch
    assert all(s.row_id in good for s in third)
    # Each bad row was met once in epoch 0 (and maybe again in epoch 1, never more).
    for reason, count in Counter(expected.values()).items():
        assert count <= dataset.skipped[reason] <= 2 * count


def test_loader_order_depends_only_on_the_seed(corpus, processor) -> None:
    path, _, _ = corpus
    a = _run(PromptLoader(_dataset(path, processor), batch_size=4, seed=7), 6)
    b = _run(PromptLoader(_dataset(path, processor), batch_size=4, seed=7), 6)
    c = _run(PromptLoader(_dataset(path, processor), batch_size=4, seed=8), 6)
    assert a == b
    assert a != c
    # Epochs are reshuffled: the order within epoch 1 differs from epoch 0's.
    flat = [i for batch in a for i in batch]
    assert flat[:N_GOOD] != flat[N_GOOD : 2 * N_GOOD]
    assert sorted(flat[N_GOOD : 2 * N_GOOD]) == sorted(flat[:N_GOOD])


def test_unshuffled_loader_follows_file_order(corpus, processor) -> None:
    path, _, good = corpus
    loader = PromptLoader(_dataset(path, processor), batch_size=5, seed=0, shuffle=False)
    assert [i for batch in _run(loader, 2) for i in batch] == good


@pytest.mark.parametrize("stop_after", [1, 2, 3])
def test_loader_state_resumes_the_exact_sequence(corpus, processor, tmp_path, stop_after: int) -> None:
    path, _, _ = corpus
    reference = PromptLoader(_dataset(path, processor), batch_size=4, seed=11)
    _run(reference, stop_after)
    state = reference.state_dict()
    torch.save(state, tmp_path / "loader.pt")  # as a checkpoint stores it
    expected = _run(reference, 5)

    resumed = PromptLoader(_dataset(path, processor), batch_size=4, seed=11)
    resumed.load_state_dict(torch.load(tmp_path / "loader.pt"))
    assert resumed.state_dict() == state
    assert _run(resumed, 5) == expected
    assert resumed.state_dict() == reference.state_dict()


def test_fresh_loader_without_state_does_not_resume(corpus, processor) -> None:
    path, _, _ = corpus
    a = PromptLoader(_dataset(path, processor), batch_size=4, seed=11)
    _run(a, 2)
    b = PromptLoader(_dataset(path, processor), batch_size=4, seed=11)
    assert _run(a, 1) != _run(b, 1)


def test_loader_with_no_usable_rows_stops_with_the_skip_counts_instead_of_spinning(
    tmp_path, processor
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "x"}\n{"answer": "y"}\nnot json\n')
    loader = PromptLoader(_dataset(path, processor), batch_size=2, seed=0)
    with pytest.raises(ConfigError, match=r"no usable row; all 3 rows read were skipped") as info:
        loader.next_batch()
    assert all(f"{reason} 1" in str(info.value) for reason in ("missing_answer", "missing_prompt", "bad_row"))


def test_empty_training_set_is_refused(tmp_path, processor) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        PromptLoader(_dataset(path, processor), batch_size=2, seed=0)


def test_missing_data_file_names_the_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        read_rows([str(tmp_path / "nope.jsonl")])


def test_relative_images_resolve_against_the_data_file_folder(
    corpus, processor, tmp_path, monkeypatch
) -> None:
    path, _, good = corpus
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    dataset = _dataset(path, processor)
    assert dataset.prepare(good[0]) is not None


def test_prompt_length_limit_is_inclusive(corpus, processor) -> None:
    path, _, good = corpus
    length = len(_dataset(path, processor).prepare(good[0]).prompt_ids)
    rows = read_rows([str(path)])
    at_limit = PromptDataset(rows, DataConfig(max_prompt_length=length), _inputs(processor))
    below = PromptDataset(rows, DataConfig(max_prompt_length=length - 1), _inputs(processor))
    assert at_limit.prepare(good[0]) is not None
    assert below.prepare(good[0]) is None
    assert below.skipped == Counter(prompt_too_long=1)


def test_checks_made_ahead_skip_the_same_rows_and_are_cached(
    corpus, processor, tmp_path, monkeypatch
) -> None:
    """`check_rows` finds every media-free defect once, for the same reason the lazy path gives; a second
    dataset over the same file and settings reads its cached results; a changed setting or file checks anew."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path, expected, good = corpus
    dataset = _dataset(path, processor)
    dataset.check_rows()
    checked = {i: reason for i, (reason, _) in dataset.checked.items()}
    assert checked == {i: reason for i, reason in expected.items() if reason != "bad_image"}  # images: lazily
    assert dataset.media_rows() == len(dataset) - 3  # all but the text-only row and the two bad_row lines
    assert [dataset.prepare(i) is not None for i in range(len(dataset))] == [
        i in good for i in range(len(dataset))
    ]
    assert dataset.skipped == Counter(expected.values())

    def no_check(*_: Any) -> None:
        raise AssertionError("a row was checked again")

    monkeypatch.setattr(PromptDataset, "_text", no_check)
    again = _dataset(path, processor)
    again.check_rows()  # from the cache: no row is checked
    assert again.checked == dataset.checked and again.media_rows() == dataset.media_rows()
    stricter = _dataset(path, processor, max_prompt_length=32)
    with pytest.raises(AssertionError, match="checked again"):
        stricter.check_rows()
    with path.open("a") as lines:
        lines.write(json.dumps({"problem": "One more?", "answer": "yes"}) + "\n")
    with pytest.raises(AssertionError, match="checked again"):
        _dataset(path, processor).check_rows()


def test_a_training_set_that_fails_its_checks_is_refused_before_the_first_batch(tmp_path, processor) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "x"}\n{"answer": "y"}\nnot json\n')
    dataset = _dataset(path, processor)
    dataset.check_rows()
    with pytest.raises(
        ConfigError, match=r"all 3 rows read were skipped \(missing_answer 1, missing_prompt 1"
    ):
        PromptLoader(dataset, batch_size=2, seed=0)


def _streamed(path: Path, processor: Any, buffer: int) -> StreamLoader:
    cfg = DataConfig(
        train_files=[str(path)], streaming=True, shuffle_buffer=buffer, max_prompt_length=MAX_PROMPT
    )
    dataset = PromptDataset.from_config(cfg, _inputs(processor))
    return make_loader(dataset, cfg.model_copy(update={"train_batch_size": 4}), seed=11)


@pytest.mark.parametrize("stop_after", [2, 4])
def test_streamed_rows_are_shuffled_through_a_buffer_and_resume_exactly(
    corpus, processor, tmp_path, monkeypatch, stop_after: int
) -> None:
    """`data.streaming`: rows read in place through a seeded buffer smaller than the data; a loader
    restored from a saved cursor gives the uninterrupted run's batches, across an epoch's end."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache := tmp_path / "cache"))
    path, expected, good = corpus
    reference = _streamed(path, processor, buffer=5)
    first = [row for batch in _run(reference, 2) for row in batch]  # 8 of the 10 good rows
    assert sorted(first) != first, "shuffled"
    assert set(first) < set(good)
    _run(reference, stop_after - 2)
    state = reference.state_dict()
    torch.save(state, tmp_path / "loader.pt")
    expected_batches = _run(reference, 5)  # across the end of an epoch
    assert reference.epoch >= 1

    resumed = _streamed(path, processor, buffer=5)
    resumed.load_state_dict(torch.load(tmp_path / "loader.pt"))
    assert _run(resumed, 5) == expected_batches
    assert resumed.state_dict() == reference.state_dict()
    assert reference.dataset.skipped == Counter(expected.values())  # each bad row counted once, lazily
    assert not list(cache.rglob("*.arrow")), "a stream is read in place, never converted"


def test_prefetching_gives_the_same_batches_and_checkpoints_only_what_was_handed_out(
    corpus, processor
) -> None:
    """`PrefetchLoader` prepares batch k+1 in the background, yet its batches, skip counts and the state a
    checkpoint takes after batch k are the plain loader's; restoring that state drops the prefetched batch."""
    path, _, _ = corpus
    plain = PromptLoader(_dataset(path, processor), batch_size=4, seed=5)
    ahead = PrefetchLoader(PromptLoader(_dataset(path, processor), batch_size=4, seed=5))
    states = []
    for _ in range(7):  # past an epoch's end, bad rows met on the way
        assert [s.row_id for s in ahead.next_batch()] == [s.row_id for s in plain.next_batch()]
        expected = {"loader": plain.state_dict(), "bad_rows": plain.dataset.bad_rows, "huge_rows": {}}
        assert ahead.source_state() == expected
        assert (ahead.skipped, ahead.epoch) == (plain.dataset.skipped, plain.epoch)
        states.append(ahead.source_state())
    rest = _run(plain, 3)
    ahead.load_source_state(states[-1])
    assert [[s.row_id for s in ahead.next_batch()] for _ in range(3)] == rest
    ahead.close()
