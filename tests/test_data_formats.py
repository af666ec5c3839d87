"""Datasets in the layouts people already have: EasyR1 and verl rows, parquet/arrow/json files, hub-style
and `save_to_disk` folders picked by `FOLDER@SPLIT`. Files are written here in the published layouts."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmrl.cli import main
from mmrl.config import DataConfig
from mmrl.data.dataset import PromptDataset, PromptInputs
from mmrl.data.rows import RowStream, read_rows, resolve_data
from mmrl.errors import ConfigError
from mmrl.models import load_processor
from mmrl.processors import PixelBudget

BUDGET = PixelBudget(min_pixels=56 * 56, max_pixels=56 * 56)  # every image becomes 4 image tokens
TOKENS_PER_IMAGE = 4
# How HF `datasets` stores an Image feature in parquet and arrow files.
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
EASYR1_SCHEMA = pa.schema([("images", pa.list_(IMAGE)), ("problem", pa.string()), ("answer", pa.string())])
INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final "
    "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
    "BE put in \\boxed{}."
)


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Any:
    return load_processor(tiny_model_dir)


def _png(colour: tuple[int, int, int] = (200, 0, 0), size: tuple[int, int] = (60, 50)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def _inputs(processor: Any) -> PromptInputs:
    return PromptInputs(processor.tokenizer, processor.image_processor, BUDGET)


def _dataset(rows: list[tuple[dict[str, Any], Path]], processor: Any, **kwargs: Any) -> PromptDataset:
    """`kwargs`: fields of the `data` section."""
    return PromptDataset(rows, DataConfig(max_prompt_length=256, **kwargs), _inputs(processor))


def _pads(sample: Any, processor: Any) -> int:
    return sample.prompt_ids.count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def _text(sample: Any, processor: Any) -> str:
    return processor.tokenizer.decode(sample.prompt_ids)


def _geometry3k_rows(image_dir: Path) -> list[dict[str, Any]]:
    """EasyR1's geometry3k rows: one embedded image, a relative path, and two images in one row."""
    (image_dir / "img").mkdir(parents=True, exist_ok=True)
    (image_dir / "img" / "b.png").write_bytes(_png((0, 0, 200)))
    return [
        {"images": [{"bytes": _png(), "path": None}], "problem": "<image>Find x.", "answer": "3"},
        {
            "images": [{"bytes": None, "path": "img/b.png"}],
            "problem": "<image>Find the area of the circle.",
            "answer": "25\\pi",
        },
        {
            "images": [
                {"bytes": _png(), "path": None},
                {"bytes": _png((0, 150, 0), (120, 30)), "path": None},
            ],
            "problem": "<image> and <image>: find y.",
            "answer": "2\\sqrt{13}",
        },
    ]


def _write_hub_folder(root: Path) -> Path:
    """A downloaded hub dataset: `data/<split>-00000-of-00001.parquet`, images relative to the root."""
    (root / "data").mkdir(parents=True)
    rows = _geometry3k_rows(root)
    pq.write_table(pa.Table.from_pylist(rows, EASYR1_SCHEMA), root / "data" / "train-00000-of-00001.parquet")
    pq.write_table(
        pa.Table.from_pylist(rows[:1], EASYR1_SCHEMA), root / "data" / "test-00000-of-00001.parquet"
    )
    (root / "README.md").write_text("---\nlicense: mit\n---\n")
    return root


def test_easyr1_geometry3k_layout_from_a_hub_folder(tmp_path: Path, processor: Any) -> None:
    root = _write_hub_folder(tmp_path / "geometry3k")
    dataset = _dataset(read_rows([f"{root}@train"]), processor)
    assert dataset.format == "easyr1"
    samples = dataset.prepare_all()
    assert not dataset.skipped
    assert [s.ground_truth for s in samples] == ["3", "25\\pi", "2\\sqrt{13}"]
    assert [len(s.images) for s in samples] == [1, 1, 2]
    assert [_pads(s, processor) for s in samples] == [
        TOKENS_PER_IMAGE,
        TOKENS_PER_IMAGE,
        2 * TOKENS_PER_IMAGE,
    ]
    assert samples[1].images[0].getpixel((10, 10)) == (0, 0, 200)  # the path image, read from the root
    assert [s.image_sizes[-1].original for s in samples] == [(60, 50), (60, 50), (120, 30)]
    assert all(s.extra == {} for s in samples)
    assert len(read_rows([f"{root}@test"])) == 1


def test_easyr1_rows_with_choices_raw_bytes_paths_and_pil_images(tmp_path: Path, processor: Any) -> None:
    Image.open(io.BytesIO(_png())).save(tmp_path / "a.png")
    rows = [
        {"problem": "<image>Find x.", "answer": "B", "images": [_png()], "choices": ["1", "2", "3", "4"]},
        {"problem": "<image>Find x.", "answer": "2", "images": ["a.png"]},
        {
            "problem": "Find x.",
            "answer": "2",
            "images": [Image.new("RGB", (60, 50))],
        },  # no marker: image first
    ]
    samples = _dataset([(r, tmp_path) for r in rows], processor).prepare_all()
    assert len(samples) == 3
    assert samples[0].extra == {"choices": ["1", "2", "3", "4"]}
    assert all(_pads(s, processor) == TOKENS_PER_IMAGE for s in samples)


def _geo3k_row(
    index: int, problem: str, answer: str, image: bytes, system: str | None = None
) -> dict[str, Any]:
    """One row as verl's examples/data_preprocess/geo3k.py writes it."""
    messages = [{"role": "user", "content": problem + " " + INSTRUCTION}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": messages,
        "images": [{"bytes": image, "path": None}],
        "ability": "math",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"split": "train", "index": index, "answer": answer, "question": problem},
    }


def _write_geo3k(path: Path, rows: list[dict[str, Any]]) -> Path:
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("images", pa.list_(IMAGE)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [
                        ("split", pa.string()),
                        ("index", pa.int64()),
                        ("answer", pa.string()),
                        ("question", pa.string()),
                    ]
                ),
            ),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema), path)
    return path


def test_verl_geo3k_layout(tmp_path: Path, processor: Any) -> None:
    path = _write_geo3k(
        tmp_path / "train.parquet",
        [
            _geo3k_row(0, "<image>Find x.", "3", _png()),
            _geo3k_row(1, "<image>Find y.", "8", _png(), system="Answer with a number."),
        ],
    )
    dataset = _dataset(read_rows([str(path)]), processor, system_prompt="the config's system prompt")
    assert dataset.format == "verl"
    plain, with_system = dataset.prepare_all()
    assert [plain.ground_truth, with_system.ground_truth] == ["3", "8"]
    assert _pads(plain, processor) == _pads(with_system, processor) == TOKENS_PER_IMAGE
    assert plain.prompt_text == "<image>Find x. " + INSTRUCTION
    assert "<|im_start|>system\nthe config's system prompt<|im_end|>" in _text(plain, processor)
    assert "<|im_start|>system\nAnswer with a number.<|im_end|>" in _text(with_system, processor)
    assert "config's" not in _text(with_system, processor)  # the row's own system message wins
    assert with_system.extra == {
        "data_source": "hiyouga/geometry3k",
        "ability": "math",
        "extra_info": {"split": "train", "index": 1, "answer": "8", "question": "<image>Find y."},
        "split": "train",
        "index": 1,
        "answer": "8",
        "question": "<image>Find y.",
    }


def test_verl_prompt_goes_through_the_format_template(tmp_path: Path, processor: Any) -> None:
    path = _write_geo3k(tmp_path / "train.parquet", [_geo3k_row(0, "<image>Find x.", "3", _png())])
    template = "{{ content | replace(' You FIRST', '\\nYou FIRST') }} Keep it short."
    (sample,) = _dataset(read_rows([str(path)]), processor, format_prompt=template).prepare_all()
    assert sample.prompt_text.startswith("<image>Find x.\nYou FIRST")
    assert sample.prompt_text.endswith("Keep it short.")
    assert _pads(sample, processor) == TOKENS_PER_IMAGE


def test_verl_messages_with_content_parts(tmp_path: Path, processor: Any) -> None:
    content = [{"type": "image"}, {"type": "text", "text": "Find x."}]
    row = {
        "prompt": [{"role": "user", "content": content}],
        "images": [_png()],
        "reward_model": {"ground_truth": "3"},
    }
    (sample,) = _dataset([(row, tmp_path)], processor).prepare_all()
    assert sample.prompt_text == "<image>Find x."
    assert _pads(sample, processor) == TOKENS_PER_IMAGE


def test_bad_verl_rows_are_skipped_with_reasons(tmp_path: Path, processor: Any) -> None:
    good = _geo3k_row(0, "<image>Find x.", "3", _png())
    assistant = [*good["prompt"], {"role": "assistant", "content": "3"}]
    rows = [
        good,
        good | {"reward_model": {"ground_truth": "", "style": "rule"}},
        good | {"reward_model": None},
        good | {"prompt": assistant},
        good | {"prompt": [{"role": "system", "content": "Be brief."}]},
        good | {"prompt": [{"role": "user", "content": [{"type": "audio"}]}]},
        good | {"prompt": 7},
        good | {"prompt": None},
        good | {"images": [{"bytes": None, "path": None}]},
        good | {"images": [{"bytes": b"not a png", "path": None}]},
    ]
    dataset = _dataset([(r, tmp_path) for r in rows], processor, format="verl")
    assert [s.row_id for s in dataset.prepare_all()] == [0]
    assert dataset.skipped == Counter(missing_answer=2, bad_prompt=3, missing_prompt=2, bad_image=2)


def test_dotted_keys_and_explicit_format(tmp_path: Path, processor: Any) -> None:
    rows = [
        {"q": {"text": "<image>Find x."}, "meta.gt": "5", "images": [_png()], "extra_info": {"answer": "5"}},
    ]
    (sample,) = _dataset(
        [(r, tmp_path) for r in rows], processor, prompt_key="q.text", answer_key="extra_info.answer"
    ).prepare_all()
    assert sample.ground_truth == "5"
    assert sample.extra == {"meta.gt": "5"}  # the columns read from are not repeated in extra
    (literal,) = _dataset(
        [(r, tmp_path) for r in rows], processor, prompt_key="q.text", answer_key="meta.gt"
    ).prepare_all()
    assert literal.ground_truth == "5"  # a column whose name has a dot is read as that column
    with pytest.raises(ConfigError, match=r"data\.format"):
        # A section built unvalidated (`model_construct`): the dataset still refuses the layout.
        PromptDataset([], DataConfig.model_construct(format="sharegpt"), _inputs(processor))


def _write_arrow(path: Path, rows: list[dict[str, Any]]) -> None:
    table = pa.Table.from_pylist(rows, EASYR1_SCHEMA)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _write_saved_dict(root: Path) -> Path:
    """The layout `DatasetDict.save_to_disk` writes: one folder per split with arrow shards and state."""
    rows = _geometry3k_rows(root)
    (root / "dataset_dict.json").parent.mkdir(parents=True, exist_ok=True)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    for split, part in (("train", rows), ("test", rows[:1])):
        folder = root / split
        folder.mkdir()
        names = [f"data-{i:05d}-of-{len(part):05d}.arrow" for i in range(len(part))]
        for name, row in zip(names, part, strict=True):
            _write_arrow(folder / name, [row])
        (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
        state = {"_data_files": [{"filename": n} for n in names], "_split": split, "_fingerprint": "0"}
        (folder / "state.json").write_text(json.dumps(state))
    return root


def test_save_to_disk_folder_and_split_spec(tmp_path: Path, processor: Any) -> None:
    root = _write_saved_dict(tmp_path / "saved")
    train = read_rows([f"{root}@train"])
    assert [row["answer"] for row, _ in train] == ["3", "25\\pi", "2\\sqrt{13}"]
    assert {base for _, base in train} == {root}  # relative image paths start at the named folder
    samples = _dataset(train, processor).prepare_all()
    assert [_pads(s, processor) for s in samples] == [
        TOKENS_PER_IMAGE,
        TOKENS_PER_IMAGE,
        2 * TOKENS_PER_IMAGE,
    ]
    assert [row["answer"] for row, _ in read_rows([f"{root}@test"])] == ["3"]
    assert [row["answer"] for row, _ in read_rows([str(root / "test")])] == ["3"]  # one saved split
    with pytest.raises(ConfigError, match=r"splits \['train', 'test'\]; name one"):
        read_rows([str(root)])
    with pytest.raises(ConfigError, match="no split 'val'"):
        read_rows([f"{root}@val"])


def test_folder_of_split_files(tmp_path: Path) -> None:
    (tmp_path / "ds" / "val").mkdir(parents=True)
    (tmp_path / "ds" / "train.jsonl").write_text(json.dumps({"problem": "a", "answer": "1"}) + "\n")
    (tmp_path / "ds" / "train.json").write_text(json.dumps([{"problem": "b", "answer": "2"}]))
    (tmp_path / "ds" / "meta.json").write_text("{}")
    (tmp_path / "ds" / "test.json").write_text(
        '{"problem": "d", "answer": "4"}\n{"problem": "e", "answer": "5"}\n'
    )
    pq.write_table(
        pa.Table.from_pylist([{"problem": "c", "answer": "3"}]), tmp_path / "ds" / "val" / "0000.parquet"
    )
    assert [r["problem"] for r, _ in read_rows([f"{tmp_path / 'ds'}@train"])] == ["b", "a"]
    assert [r["problem"] for r, _ in read_rows([f"{tmp_path / 'ds'}@val"])] == ["c"]
    assert [r["problem"] for r, _ in read_rows([f"{tmp_path / 'ds'}@test"])] == ["d", "e"]  # JSON lines
    with pytest.raises(ConfigError, match="is a file"):
        read_rows([f"{tmp_path / 'ds' / 'train.jsonl'}@train"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no data files"):
        read_rows([str(tmp_path / "empty")])


def test_hub_name_is_read_from_the_local_cache_or_explained(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with pytest.raises(
        FileNotFoundError, match=r"could not load 'hiyouga/geometry3k'.*huggingface-cli download"
    ):
        read_rows(["hiyouga/geometry3k@train"])  # the suite runs with HF_HUB_OFFLINE=1 (conftest)
    repo = tmp_path / "hub" / "datasets--hiyouga--geometry3k"
    _write_hub_folder(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    source = resolve_data("hiyouga/geometry3k@test")
    assert source.base == repo / "snapshots" / "abc123"
    assert source.files == [source.base / "data" / "test-00000-of-00001.parquet"]


def _cache_as_datasets_would(cache: Path, hub_id: str, files: dict[str, list[str]]) -> None:
    """What `datasets.load_dataset(hub_id)` leaves in its cache after a download: the prepared Arrow
    splits under OWNER___NAME/CONFIG/VERSION/REVISION. Built here from local parquet files (no hub)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    name = hub_id.split("/")[1]
    builder = Parquet(cache_dir=str(cache / "_build"), dataset_name=name, hash="0a1b2c", data_files=files)
    builder.download_and_prepare()
    (prepared,) = (cache / "_build").glob(f"{name}/*/*/0a1b2c")
    target = cache / hub_id.replace("/", "___") / "default" / "0.0.0" / "0a1b2c"
    target.parent.mkdir(parents=True)
    prepared.rename(target)


def test_hub_id_is_resolved_offline_from_the_datasets_cache(
    tmp_path: Path, monkeypatch, processor: Any
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # no snapshot there
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache := tmp_path / "datasets"))
    root = _write_hub_folder(tmp_path / "download")
    data = {split: [str(root / "data" / f"{split}-00000-of-00001.parquet")] for split in ("train", "test")}
    _cache_as_datasets_would(cache, "hiyouga/geometry3k", data)
    (root / "img" / "b.png").unlink()  # only the cache is read: the one image stored as a path is gone

    rows = read_rows(["hiyouga/geometry3k@train"])
    assert [row["answer"] for row, _ in rows] == ["3", "25\\pi", "2\\sqrt{13}"]
    assert isinstance(rows[0][0]["images"][0]["bytes"], bytes)  # embedded images stay undecoded
    dataset = _dataset(rows, processor)
    assert len(dataset.prepare_all()) == 2 and dict(dataset.skipped) == {"bad_image": 1}
    assert len(read_rows(["hiyouga/geometry3k@test"])) == 1
    streamed = RowStream(["hiyouga/geometry3k@train"])  # `data.streaming`: the same rows, read in order
    assert [row for row, _ in streamed] == [row for row, _ in rows]
    with pytest.raises(ConfigError, match=r"no split 'val'; the folder has \['test', 'train'\]"):
        read_rows(["hiyouga/geometry3k@val"])


def test_from_config_uses_the_data_section(tmp_path: Path, processor: Any) -> None:
    path = _write_geo3k(tmp_path / "train.parquet", [_geo3k_row(0, "<image>Find x.", "3", _png())])
    cfg = DataConfig(
        train_files=[str(path)], format="verl", answer_key="extra_info.question", system_prompt="S"
    )
    dataset = PromptDataset.from_config(cfg, _inputs(processor))
    (sample,) = dataset.prepare_all()
    assert sample.ground_truth == "<image>Find x."
    assert "<|im_start|>system\nS<|im_end|>" in _text(sample, processor)


def test_train_rejects_an_unknown_split_before_loading_anything(
    tmp_path: Path, capsys, tiny_model_dir
) -> None:
    root = _write_hub_folder(tmp_path / "geometry3k")
    config = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml")
    overrides = [f"model.path={tiny_model_dir}", f"data.train_files={root}@validation", "data.val_files=[]"]
    assert main(["train", config, *overrides, f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "data.train_files" in err and "no split 'validation'" in err and "test" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("single", [False, True], ids=["image lists", "one image per row"])
def test_checks_ahead_count_embedded_images_without_reading_them(
    tmp_path: Path, processor: Any, monkeypatch, single: bool
) -> None:
    """`check_rows` over a parquet of embedded images finds the marker mismatches and media rows the
    lazy path finds, with the image bytes replaced by stand-ins (corrupt bytes would not be noticed)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    broken = {"bytes": b"not a png", "path": None}
    good = {"bytes": _png(), "path": None}
    rows = [
        {"problem": "<image> and <image>?", "answer": "a", "images": good},  # two markers, one image
        {"problem": "<image>Which colour?", "answer": "a", "images": broken},  # found only lazily
        {"problem": "<image>Which colour?", "answer": "a", "images": good},
        {"problem": "How many sides has a square?", "answer": "4", "images": None},
    ]
    schema = EASYR1_SCHEMA
    if single:
        schema = pa.schema([("images", IMAGE), ("problem", pa.string()), ("answer", pa.string())])
    else:
        rows = [{**row, "images": None if row["images"] is None else [row["images"]]} for row in rows]
    pq.write_table(pa.Table.from_pylist(rows, schema), path := tmp_path / "train.parquet")

    ahead = _dataset(read_rows([str(path)]), processor)
    ahead.check_rows()
    assert {i: reason for i, (reason, _) in ahead.checked.items()} == {0: "image_marker_mismatch"}
    assert ahead.media_rows() == 3
    lazy = _dataset(read_rows([str(path)]), processor)
    assert [lazy.prepare(i) is not None for i in range(4)] == [ahead.prepare(i) is not None for i in range(4)]
    assert lazy.bad_rows == ahead.bad_rows == {0: "image_marker_mismatch", 1: "bad_image"}
