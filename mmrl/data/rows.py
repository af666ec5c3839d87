"""The rows of a data set, memory-mapped through Hugging Face `datasets` and read when a batch needs them.

Every source becomes Arrow tables in `datasets`' cache that are memory-mapped, not Python lists, so host
memory does not grow with the data, and the second run on the same files finds them converted:
- parquet files are converted once to Arrow in `datasets`' cache (keyed on the files' paths, sizes, times);
- arrow files and `save_to_disk` folders are mapped where they lie;
- jsonl and json files keep each row as its JSON text: `datasets`' json builder refuses a whole file over
  one malformed line or one column whose type changes between rows, where mmrl skips and counts that row;
- hub ids `OWNER/NAME@SPLIT` come from a local snapshot (`huggingface-cli download`) if there is one, else
  from `datasets.load_dataset`, which downloads once and reads its own cache offline.

Images and videos stay as stored (paths or bytes); `mmrl.data.dataset` decodes them when it prepares the row.
`stream_rows` reads the same sources one row at a time without converting them (`data.streaming`).
"""

from __future__ import annotations

import bisect
import codecs
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mmrl.errors import ConfigError, read_json

T = TypeVar("T")

if TYPE_CHECKING:
    import datasets

Row = tuple[dict[str, Any], Path]
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# Metadata that sits beside data files: `save_to_disk` bookkeeping and `mmrl data synth`'s summary.
_NOT_DATA = {"dataset_info.json", "state.json", "dataset_dict.json", "meta.json"}
_SHARD_STEM = re.compile(r"([A-Za-z]\w*?)(?:-\d+-of-\d+)?")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class Source:
    """What one data spec names: local files (relative image paths start from `base`), or a hub dataset
    `hub_id` that `datasets` loads (its images are embedded, so `base` is only a fallback)."""

    base: Path
    files: list[Path] = field(default_factory=list)
    hub_id: str | None = None
    split: str | None = None


def resolve_data(spec: str) -> Source:
    """The files or hub dataset that `spec` names, or an error that says how to fix it.

    `spec` is a data file; a folder saved with `datasets.save_to_disk` or holding split files
    (`data/train-00000-of-00001.parquet`, `train.jsonl`, `test/0000.parquet`); either with `@SPLIT`; or a
    hub id `OWNER/NAME@SPLIT`: its local snapshot if `huggingface-cli download` made one, else `datasets`
    loads it (a download when online, its cache when offline).
    """
    name, split = spec, None
    if not Path(spec).exists() and "@" in spec:
        name, _, split = spec.rpartition("@")
    path = Path(name)
    if not path.exists():
        snapshot = _hub_snapshot(name)
        if snapshot is None and _HUB_ID.fullmatch(name) and not path.suffix:
            return Source(base=Path.cwd(), hub_id=name, split=split)
        if snapshot is None:
            raise FileNotFoundError(
                f"data file {spec} does not exist (check data.train_files / data.val_files)"
            )
        path = snapshot
    if path.is_dir():
        return Source(base=path, files=_split_files(path, split, spec))
    if split is not None:
        raise ConfigError(f"data {spec}: @{split} picks a split of a dataset folder, but {name} is a file")
    return Source(base=path.parent, files=[path])


def _hub_snapshot(name: str) -> Path | None:
    """The local hub cache's snapshot of dataset `name` (what `huggingface-cli download` fills)."""
    if name.count("/") != 1:
        return None
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    repo = Path(os.environ.get("HF_HUB_CACHE", home / "hub")) / f"datasets--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = repo / "snapshots" / ref.read_text(encoding="utf-8").strip()
    return snapshot if snapshot.is_dir() else None


def _split_files(folder: Path, split: str | None, spec: str) -> list[Path]:
    """The data files of one split of a dataset folder."""
    if (folder / "dataset_dict.json").is_file():  # save_to_disk of a DatasetDict: one folder per split
        splits = _read_meta(folder / "dataset_dict.json", spec, lambda meta: list(meta["splits"]))
        chosen = _pick_split(splits, split, spec)
        return _split_files(folder / chosen, None, f"{spec}/{chosen}")
    if (folder / "state.json").is_file():  # save_to_disk of one Dataset
        saved, files = _read_meta(
            folder / "state.json",
            spec,
            lambda meta: (meta.get("_split"), [folder / entry["filename"] for entry in meta["_data_files"]]),
        )
        if split is not None and split != saved:
            raise ConfigError(f"data {spec}: {folder} holds a single split ({saved}); drop @{split}")
        return files
    by_split: dict[str, list[Path]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.suffix in DATA_SUFFIXES):
        rel = path.relative_to(folder)
        if path.name not in _NOT_DATA and not any(part.startswith(".") for part in rel.parts):
            by_split.setdefault(_split_name(rel), []).append(path)
    return by_split[_pick_split(sorted(by_split), split, spec)]


def _read_meta(path: Path, spec: str, read: Callable[[Any], T]) -> T:
    """What `read` takes from a dataset folder's `datasets` metadata (`dataset_dict.json`, `state.json`);
    a truncated or foreign file is one line naming it."""
    fix = "the dataset's splits are unknown: save the dataset again (`save_to_disk`), or give its data files"
    return read_json(path, read, fix, what=f"data {spec}: ")


def _split_name(rel: Path) -> str:
    """`train` for `train.jsonl`, `data/train-00000-of-00002.parquet` and `train/0000.parquet`."""
    match = _SHARD_STEM.fullmatch(rel.stem)
    return match.group(1) if match else rel.parent.name


def _pick_split(splits: list[str], split: str | None, spec: str) -> str:
    if not splits:
        raise ConfigError(f"data {spec}: no data files ({', '.join(DATA_SUFFIXES)}) in this folder")
    if split is None and len(splits) == 1:
        return splits[0]
    if split is None:
        raise ConfigError(f"data {spec}: the folder has splits {splits}; name one, e.g. {spec}@{splits[0]}")
    if split not in splits:
        raise ConfigError(f"data {spec}: no split {split!r}; the folder has {splits}")
    return split


def cache_dir() -> str:
    """`datasets`' cache folder, read when called (HF_DATASETS_CACHE may change after import)."""
    from datasets import config

    return os.environ.get("HF_DATASETS_CACHE") or str(config.HF_DATASETS_CACHE)


@dataclass
class Part:
    """One memory-mapped table of rows. `as_json`: each row is a `line` of JSON text (jsonl and json files).
    `key` names the table's content for caches: `datasets`' fingerprint plus the files' sizes and times."""

    table: datasets.Dataset
    base: Path
    as_json: bool
    key: str

    @cached_property
    def arrow(self) -> datasets.Dataset:
        # Arrow access hands image columns over as stored ({bytes, path}), where the python format would
        # decode every image of the row on access.
        return self.table.with_format("arrow")

    def __len__(self) -> int:
        return len(self.table)

    def row(self, index: int) -> dict[str, Any]:
        if self.as_json:
            return json_row(self.table[index]["line"])
        return self.arrow[index : index + 1].to_pylist()[0]


class Rows(Sequence[Row]):
    """All rows of the named data as one sequence of (row, base folder of its relative paths), read one
    at a time from memory-mapped parts."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self.starts = [0]
        for part in parts:
            self.starts.append(self.starts[-1] + len(part))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> Row:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        k = bisect.bisect_right(self.starts, index) - 1
        return self.parts[k].row(index - self.starts[k]), self.parts[k].base

    def columns(self) -> set[str]:
        """Every column a row has (for JSON text, the union of the rows' keys)."""
        names: set[str] = set()
        for part in self.parts:
            if part.as_json:
                names.update(*(json_row(line).keys() for line in part.table["line"]))
            else:
                names.update(part.table.column_names)
        return names - {"__bad__"}


def read_rows(specs: list[str]) -> Rows:
    """The rows of every named data spec (see `resolve_data`), memory-mapped."""
    parts: list[Part] = []
    for spec in specs:
        source = resolve_data(spec)
        if source.hub_id is not None:
            parts.append(_hub_part(source, spec))
        parts += [_file_part(path, source.base) for path in source.files]
    return Rows(parts)


def _file_part(path: Path, base: Path) -> Part:
    import datasets

    stat = path.stat()
    stamp = f"{stat.st_size}-{stat.st_mtime_ns}"
    if path.suffix in (".jsonl", ".json"):
        features = datasets.Features({"line": datasets.Value("binary")})
        if next(_json_texts(path), None) is None:  # `datasets` refuses to build a table of no rows
            return Part(datasets.Dataset.from_dict({"line": []}, features), base, as_json=True, key=stamp)
        table = datasets.Dataset.from_generator(
            _json_lines,
            features=features,
            gen_kwargs={"path": str(path.resolve()), "stamp": stamp},
            cache_dir=cache_dir(),
        )
        return Part(table, base, as_json=True, key=f"{table._fingerprint}-{stamp}")
    if path.suffix == ".parquet":
        table = datasets.Dataset.from_file(str(_parquet_as_arrow(path, stamp)))
    elif path.suffix == ".arrow":
        table = _arrow_file(path)
    else:
        raise ConfigError(
            f"data file {path}: unsupported format {path.suffix!r}; use {', '.join(DATA_SUFFIXES)} or a folder"
        )
    return Part(table, base, as_json=False, key=f"{table._fingerprint}-{stamp}")


def _parquet_as_arrow(path: Path, stamp: str) -> Path:
    """The parquet file converted once to an Arrow stream file in `datasets`' cache (the format it maps),
    keyed on the file's path, size and time. Written a row group's slice at a time and renamed into
    place when whole. `datasets`' own parquet builder (pyarrow's default pre-buffering) held 0.8 GB more
    than that for a 0.5 GB file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    key = hashlib.sha256(f"{path.resolve()}-{stamp}".encode()).hexdigest()[:16]
    target = Path(cache_dir()) / "mmrl_parquet" / f"{path.stem}-{key}.arrow"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    source = pq.ParquetFile(path, pre_buffer=False)  # pre-buffering keeps every row group read in memory
    partial = target.with_suffix(f".{os.getpid()}.partial")
    with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_stream(sink, source.schema_arrow) as writer:
        for batch in source.iter_batches(batch_size=256):
            writer.write_batch(batch)
    os.replace(partial, target)
    pa.default_memory_pool().release_unused()  # the decoded pages, else kept by the allocator for the run
    return target


def _arrow_file(path: Path) -> datasets.Dataset:
    """An Arrow IPC file mapped in place: the stream format `save_to_disk` writes, or the random-access
    file format."""
    import datasets
    import pyarrow as pa

    try:
        return datasets.Dataset.from_file(str(path))
    except (pa.ArrowInvalid, OSError):
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()  # zero-copy over the mapping
        return datasets.Dataset(datasets.table.InMemoryTable(table))


def _hub_part(source: Source, spec: str) -> Part:
    table = _hub_split(source, spec, streaming=False)
    return Part(table, source.base, as_json=False, key=table._fingerprint)


def _hub_split(source: Source, spec: str, streaming: bool) -> Any:
    """The named split of hub dataset `source.hub_id`, loaded (or streamed) by `datasets`."""
    import datasets

    assert source.hub_id is not None
    try:
        splits = datasets.load_dataset(source.hub_id, streaming=streaming, cache_dir=cache_dir())
    except Exception as err:  # offline, an unknown id, a gated set: each needs the same advice
        raise FileNotFoundError(_not_found(spec, source.hub_id, err)) from None
    return splits[_pick_split(sorted(splits), source.split, spec)]


def _not_found(spec: str, hub_id: str, err: Exception) -> str:
    local = f"data/{hub_id.split('/')[-1]}"
    return (
        f"data {spec}: no such file or folder, and `datasets` could not load {hub_id!r} from the hub or its "
        f"cache ({type(err).__name__}: {err}). Load it once while online (it is cached in {cache_dir()}), or "
        f"download it, e.g. `huggingface-cli download --repo-type dataset {hub_id} --local-dir {local}`, and "
        f"name the folder: {local}@train"
    )


def _json_lines(path: str, stamp: str) -> Iterator[dict[str, bytes]]:
    """Each row of a jsonl or json file as its JSON text (bytes, so a line that is not UTF-8 survives to be
    skipped by name). `stamp` (size and time) only keys `datasets`' cache to the file's content."""
    del stamp
    for line in _json_texts(Path(path)):
        yield {"line": line}


def _json_texts(path: Path) -> Iterator[bytes]:
    """The JSON text of each row: one per non-blank line (read line by line), or each element of a .json
    file's list."""
    if path.suffix == ".json":
        data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
        try:
            loaded = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            loaded = None  # JSON lines saved as .json, as the hub's json loader allows
        if loaded is not None:
            if isinstance(loaded, dict):
                loaded = [loaded]  # a single row: JSON lines with one line
            if not isinstance(loaded, list):
                raise ConfigError(f"data file {path}: a .json data file holds a list of row objects")
            yield from (json.dumps(row).encode() for row in loaded)
            return
    with path.open("rb") as lines:
        for number, line in enumerate(lines):
            if number == 0:
                line = line.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (Windows editors)
            if line.strip():
                yield line.rstrip(b"\r\n")


def json_row(line: bytes) -> dict[str, Any]:
    """A row from its JSON text; text that is not UTF-8, not JSON or not an object becomes a bad row
    (`__bad__` says why) rather than garbled or missing data."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return {"__bad__": f"line is not UTF-8 ({err.reason} at byte {err.start}); save the file as UTF-8"}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return {"__bad__": f"invalid JSON: {err}"}
    return value if isinstance(value, dict) else {"__bad__": "row is not a JSON object"}


class RowStream:
    """The rows of the named data read in order, one at a time, without converting or caching them
    (`data.streaming`): local files batch by batch, hub ids through `datasets`' streaming mode."""

    def __init__(self, specs: list[str]) -> None:
        self.sources = [(spec, resolve_data(spec)) for spec in specs]

    def __iter__(self) -> Iterator[Row]:
        for spec, source in self.sources:
            if source.hub_id is not None:
                yield from ((row, source.base) for row in _hub_stream(source, spec))
            for path in source.files:
                yield from ((row, source.base) for row in _file_stream(path))

    def head(self, count: int) -> list[Row]:
        """The first `count` rows (the layout is read from them)."""
        return [row for row, _ in zip(self, range(count), strict=False)]


def _file_stream(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix in (".jsonl", ".json"):
        yield from map(json_row, _json_texts(path))
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=64):
            yield from batch.to_pylist()
    elif path.suffix == ".arrow":
        import pyarrow as pa

        with pa.memory_map(str(path)) as source:
            try:
                reader: Any = pa.ipc.open_stream(source)
                batches = iter(reader)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            for batch in batches:
                yield from batch.to_pylist()
    else:
        raise ConfigError(
            f"data file {path}: unsupported format {path.suffix!r}; use {', '.join(DATA_SUFFIXES)} or a folder"
        )


def _hub_stream(source: Source, spec: str) -> Iterator[dict[str, Any]]:
    yield from _hub_split(source, spec, streaming=True).decode(False)  # images as stored ({bytes, path})
