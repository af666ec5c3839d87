"""Checkpoints: written whole or not at all, torn ones ignored, weights and RNG restored exactly."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmrl.errors import ConfigError
from mmrl.models import load_policy, load_processor
from mmrl.run import checkpoint as ckpt


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Any:
    return load_processor(tiny_model_dir)


@pytest.fixture
def model(tiny_model_dir: Path) -> Any:
    return load_policy(tiny_model_dir)


def _save(root: Path, step: int, model: Any, processor: Any, keep: int = 10, **state: Any) -> Path:
    return ckpt.save_checkpoint(
        root, step, ckpt.hf_writer(model, processor), {"step": step, **state}, keep=keep
    )


def _perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.01)


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / ckpt.MANIFEST).read_text())


def test_save_writes_a_complete_folder(tmp_path, model, processor) -> None:
    folder = _save(tmp_path, 5, model, processor, loader={"epoch": 1, "position": 3})
    assert folder == tmp_path / "step_00000005"
    assert folder.is_dir()
    manifest = _manifest(folder)
    assert manifest["step"] == 5
    files = manifest["files"]
    for name in ("model/config.json", "trainer_state.pt", "model/tokenizer.json"):
        assert name in files, name
    assert any(name.startswith("model/") and name.endswith(".safetensors") for name in files)
    on_disk = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and p.name != ckpt.MANIFEST
    }
    assert files == on_disk
    assert ckpt.is_complete(folder)
    assert not list(tmp_path.glob(".tmp_*"))  # the temporary folder was renamed, not copied
    assert ckpt.load_trainer_state(folder)["loader"] == {"epoch": 1, "position": 3}
    # The model folder is a regular HF checkpoint: it loads on its own.
    reloaded = load_policy(folder / "model")
    original = model.state_dict()
    assert reloaded.state_dict().keys() == original.keys()
    assert all(torch.equal(t, original[k]) for k, t in reloaded.state_dict().items())


def test_latest_checkpoint_picks_the_newest(tmp_path, model, processor) -> None:
    assert ckpt.latest_checkpoint(tmp_path / "none") is None
    assert ckpt.latest_checkpoint(tmp_path) is None
    for step in (1, 2, 10):
        _save(tmp_path, step, model, processor)
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_00000010"  # numeric, not "1" < "10" < "2"


def _delete_listed_file(folder: Path) -> None:
    name = next(n for n in _manifest(folder)["files"] if n.endswith(".safetensors"))
    (folder / name).unlink()


def _truncate_listed_file(folder: Path) -> None:
    name = next(n for n in _manifest(folder)["files"] if n.endswith(".safetensors"))
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _truncate_trainer_state(folder: Path) -> None:
    path = folder / "trainer_state.pt"
    path.write_bytes(path.read_bytes()[:10])


def _drop_manifest(folder: Path) -> None:
    (folder / ckpt.MANIFEST).unlink()


def _corrupt_manifest(folder: Path) -> None:
    (folder / ckpt.MANIFEST).write_text('{"step": 3, "files": {')


@pytest.mark.parametrize(
    "tear",
    [_delete_listed_file, _truncate_listed_file, _truncate_trainer_state, _drop_manifest, _corrupt_manifest],
)
def test_torn_checkpoint_is_ignored(tmp_path, model, processor, tear) -> None:
    _save(tmp_path, 2, model, processor)
    newest = _save(tmp_path, 3, model, processor)
    assert ckpt.latest_checkpoint(tmp_path) == newest
    tear(newest)
    assert not ckpt.is_complete(newest)
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert ckpt.list_checkpoints(tmp_path) == [tmp_path / "step_00000002"]


def test_folder_without_manifest_is_ignored(tmp_path, model, processor) -> None:
    good = _save(tmp_path, 1, model, processor)
    half = tmp_path / "step_00000004"
    shutil.copytree(good, half)
    _drop_manifest(half)
    assert ckpt.latest_checkpoint(tmp_path) == good


def test_leftover_temporary_folder_is_ignored(tmp_path, model, processor) -> None:
    good = _save(tmp_path, 1, model, processor)
    # A process that died before the rename leaves a complete-looking temporary folder.
    shutil.copytree(good, tmp_path / ".tmp_step_00000009_12345")
    assert ckpt.latest_checkpoint(tmp_path) == good
    assert ckpt.list_checkpoints(tmp_path) == [good]


def test_saving_the_same_step_again_replaces_it(tmp_path, model, processor) -> None:
    _save(tmp_path, 3, model, processor, marker="first")
    folder = _save(tmp_path, 3, model, processor, marker="second")
    assert ckpt.load_trainer_state(folder)["marker"] == "second"
    assert ckpt.list_checkpoints(tmp_path) == [folder]


def test_keep_prunes_the_oldest(tmp_path, model, processor) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, processor, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_keep_counts_only_complete_checkpoints(tmp_path, model, processor) -> None:
    _save(tmp_path, 1, model, processor, keep=2)
    torn = _save(tmp_path, 2, model, processor, keep=2)
    _drop_manifest(torn)
    _save(tmp_path, 3, model, processor, keep=2)
    # The torn step 2 must not push the last complete older one out.
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001", "step_00000003"]


def test_load_model_weights_restores_every_tensor(tmp_path, tiny_model_dir, processor) -> None:
    trained = load_policy(tiny_model_dir)
    _perturb(trained, seed=1)
    expected = _snapshot(trained)
    folder = _save(tmp_path, 7, trained, processor)

    target = load_policy(tiny_model_dir)
    _perturb(target, seed=2)
    assert not torch.equal(target.lm_head.weight, expected["lm_head.weight"])
    before = {name: p for name, p in target.named_parameters()}
    ckpt.load_model_weights(target, folder)

    restored = target.state_dict()
    assert restored.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(restored[name], tensor), name
    # In place: the same parameter objects (an optimizer built on them keeps working).
    assert all(p is before[name] for name, p in target.named_parameters())


def test_load_model_weights_keeps_embeddings_tied(tmp_path, tiny_model_dir, processor) -> None:
    trained = load_policy(tiny_model_dir)
    assert trained.config.tie_word_embeddings
    _perturb(trained, seed=3)
    folder = _save(tmp_path, 1, trained, processor)

    target = load_policy(tiny_model_dir)
    ckpt.load_model_weights(target, folder)
    embed = target.get_input_embeddings().weight
    assert torch.equal(embed, trained.get_input_embeddings().weight)
    assert target.lm_head.weight.data_ptr() == embed.data_ptr()
    with torch.no_grad():
        embed[0, 0] += 1.0
    assert target.lm_head.weight[0, 0] == embed[0, 0]


def test_load_model_weights_refuses_a_model_folder_that_does_not_fit(tmp_path, model, processor) -> None:
    folder = _save(tmp_path, 1, model, processor)
    shutil.rmtree(folder / "model")
    with pytest.raises((FileNotFoundError, OSError, RuntimeError)):
        ckpt.load_model_weights(model, folder)


def _draws() -> tuple[list[float], list[float], list[float]]:
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
    )


def test_rng_state_round_trips(tmp_path) -> None:
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    _draws()
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")  # as trainer_state.pt stores it
    expected = _draws()
    _draws()  # move every generator on
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == expected


class _RunsCode:
    """What a hostile trainer_state.pt could hold: unpickling it writes a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "ran"))


def test_trainer_state_loads_without_unpickling_code_and_an_older_one_is_refused_until_converted(
    tmp_path, model, processor
) -> None:
    """Resuming loads trainer_state.pt with weights_only=True: every RNG state (numpy's included, with a
    cached gaussian) round-trips as tensors and plain data; a file with other objects is refused in one
    line, without running them, naming the command that converts a trusted older checkpoint."""
    np.random.seed(7)
    np.random.standard_normal()  # leaves the second gaussian of a pair cached in numpy's state
    folder = _save(tmp_path, 1, model, processor, rng=ckpt.rng_state())
    expected = (np.random.standard_normal(), _draws())
    _draws()
    ckpt.set_rng_state(ckpt.load_trainer_state(folder)["rng"])
    assert (np.random.standard_normal(), _draws()) == expected

    with pytest.raises(TypeError, match=r"trainer state\['rng'\]\['numpy'\]\[1\] is a numpy.ndarray"):
        _save(tmp_path, 2, model, processor, rng={"numpy": np.random.get_state()})  # refused when saved

    marker = tmp_path / "ran"
    torch.save({"step": 1, "payload": _RunsCode(marker)}, folder / "trainer_state.pt")
    with pytest.raises(ConfigError, match=r"trainer_state.pt holds .*can run code"):
        ckpt.load_trainer_state(folder)
    assert not marker.exists()

    older = _save(tmp_path, 3, model, processor)
    torch.save(
        {"step": 3, "rng": {**ckpt.rng_state(), "numpy": np.random.get_state()}}, older / "trainer_state.pt"
    )
    with pytest.raises(ConfigError, match=r"python -m mmrl.run.checkpoint .*step_00000003"):
        ckpt.load_trainer_state(older)
    expected = _draws()
    ckpt.convert_trusted(older)
    assert ckpt.is_complete(older)
    ckpt.set_rng_state(ckpt.load_trainer_state(older)["rng"])
    assert _draws() == expected


def test_rng_state_is_a_snapshot_not_a_live_view() -> None:
    state = ckpt.rng_state()
    first = _draws()
    second = _draws()
    assert first != second
    ckpt.set_rng_state(state)
    assert _draws() == first
