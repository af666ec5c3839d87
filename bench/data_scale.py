"""Start-up time and host memory of the data layer at scale: a parquet of 20,000 rows with embedded images.

Each case runs in a fresh process that builds the quickstart recipe's datasets and draws its first
batch; it reports the seconds that took (after imports), the process's peak RSS, and its resident
memory at the end split into anonymous memory and file pages (the memory-mapped rows' page cache,
which the kernel reclaims under pressure). Cases:
- `quickstart`: the 2,048-row quickstart set (jsonl + png files);
- `large, first run`: the large parquet with an empty `datasets` cache (converted and checked once);
- `large, second run`: the same again (the cache is reused).
`--baseline SRC` measures the same cases with another checkout's mmrl (e.g. a worktree of the commit
before the `datasets` loader) side by side. `--train-steps N` also runs N training steps of the
recipe on each set and reports that run's peak RSS.

    python bench/data_scale.py --rows 20000 --baseline /tmp/mmrl-before --train-steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import QUICKSTART, REPO, data_overrides, make_workspace, provenance

IMAGE_SIZE = 112
PROBE = """
import json, sys, time
t0 = time.perf_counter()
import datasets  # about a second (pandas), paid once per process whichever loader runs: not counted
from mmrl.config import load_config
from mmrl.data.loaders import PromptLoader
from mmrl.run.logger import peak_rss_gb
from mmrl.models import load_config as model_config, load_processor
from mmrl.sources.prompts import build_datasets
cfg = load_config(sys.argv[1], sys.argv[2:])
processor, config = load_processor(cfg.model.path), model_config(cfg.model.path)
t1 = time.perf_counter()
train, _ = build_datasets(cfg, processor, config)
PromptLoader(train, cfg.data.train_batch_size, 0).next_batch()
t2 = time.perf_counter()
status = dict(line.split(":") for line in open("/proc/self/status") if line.startswith(("RssAnon", "RssFile")))
gib = {key: int(value.split()[0]) / 2**20 for key, value in status.items()}
print(json.dumps({"import_s": t1 - t0, "data_s": t2 - t1, "rows": len(train), "peak_rss_gb": peak_rss_gb(),
                  "anon_gb": gib["RssAnon"], "file_gb": gib["RssFile"]}))
"""


def write_large(data_dir: Path, rows: int, out: Path) -> Path:
    """`rows` rows of the colour task with their images embedded, each on its own noise (incompressible,
    about 37 KB a PNG) so the file is the size of a real image set."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    if out.exists():
        return out
    source = [json.loads(line) for line in (data_dir / "train.jsonl").read_text().splitlines()]
    rng = np.random.default_rng(0)
    schema = pa.schema(
        [
            ("problem", pa.string()),
            ("answer", pa.string()),
            ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ]
    )
    with pq.ParquetWriter(out, schema) as writer:
        for start in range(0, rows, 1000):
            batch = []
            for i in range(start, min(rows, start + 1000)):
                row = source[i % len(source)]
                pixels = np.asarray(Image.open(data_dir / row["images"][0]).convert("RGB"), dtype=np.int16)
                noisy = np.clip(pixels + rng.integers(-12, 13, pixels.shape), 0, 255).astype(np.uint8)
                png = io.BytesIO()
                Image.fromarray(noisy).save(png, format="PNG")
                batch.append(
                    {
                        "problem": row["problem"],
                        "answer": row["answer"],
                        "images": [{"bytes": png.getvalue(), "path": None}],
                    }
                )
            writer.write_table(pa.Table.from_pylist(batch, schema))
    return out


def overrides(model_dir: Path, data_dir: Path, train: Path, run_dir: Path) -> list[str]:
    """The benchmarks' usual overrides (`common.data_overrides`), training on `train`."""
    return [*data_overrides(model_dir, data_dir, run_dir, IMAGE_SIZE), f"data.train_files={train}"]


def probe(src: Path, cache: Path, args: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_DATASETS_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(QUICKSTART), *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=src,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_rss(src: Path, cache: Path, args: list[str], steps: int, run_dir: Path) -> dict[str, float]:
    """Peak RSS (GiB) of `steps` training steps of the recipe, as the trainer logs it, and the peaks of its
    anonymous memory and of its file pages (the memory-mapped rows' page cache), sampled every 0.1 s."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(src), "HF_DATASETS_CACHE": str(cache)}
    command = [
        sys.executable,
        "-m",
        "mmrl.cli",
        "train",
        str(QUICKSTART),
        *args,
        f"trainer.total_steps={steps}",
    ]
    peaks = {"RssAnon": 0, "RssFile": 0}
    with subprocess.Popen(
        command, env=env, cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as run:
        while run.poll() is None:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{run.pid}/status").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(value.split()[0]))
            time.sleep(0.1)
    if run.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {run.returncode}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "train_peak_rss_gb": max(r.get("memory/peak_rss_gb", 0.0) for r in records),
        "train_anon_gb": peaks["RssAnon"] / 2**20,
        "train_file_gb": peaks["RssFile"] / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mmrl-bench-data"))
    parser.add_argument("--baseline", type=Path, help="another checkout to measure the same way")
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    work = args.workdir
    model_dir, data_dir = make_workspace(work, n_train=2048, image_size=IMAGE_SIZE)
    large = write_large(data_dir, args.rows, work / f"large-{args.rows}.parquet")
    print(f"large set: {args.rows} rows, {large.stat().st_size / 2**30:.2f} GiB of parquet")
    load = os.getloadavg()
    results = []
    for label, src in (("mmrl", REPO), *((("baseline", args.baseline),) if args.baseline else ())):
        cache = work / f"cache-{label}"
        cases = [
            ("quickstart", data_dir / "train.jsonl", True),
            ("large, first run", large, True),
            ("large, second run", large, False),
        ]
        for case, train, cold in cases:
            run_args = overrides(model_dir, data_dir, train, work / "run")
            if cold:
                shutil.rmtree(cache, ignore_errors=True)
            result = probe(src, cache, run_args)
            if args.train_steps:
                if cold:  # the training run starts from the same cache state as the probe did
                    shutil.rmtree(cache, ignore_errors=True)
                result.update(train_rss(src, cache, run_args, args.train_steps, work / "run"))
            results.append({"loader": label, "case": case, **result})
            print(json.dumps(results[-1]))
    print(
        f"\n{'loader':<9} {'case':<18} {'rows':>6} {'data start-up s':>16} {'peak RSS GiB':>13} "
        f"{'anon / file GiB':>16} {'train peak RSS GiB':>19} {'train peak anon / file':>23}"
    )
    for r in results:
        train = f"{r['train_peak_rss_gb']:.2f}" if "train_peak_rss_gb" in r else "-"
        train_split = f"{r['train_anon_gb']:.2f} / {r['train_file_gb']:.2f}" if "train_anon_gb" in r else "-"
        split = f"{r['anon_gb']:.2f} / {r['file_gb']:.2f}"
        print(
            f"{r['loader']:<9} {r['case']:<18} {r['rows']:>6} {r['data_s']:>16.2f} {r['peak_rss_gb']:>13.2f} "
            f"{split:>16} {train:>19} {train_split:>23}"
        )
    if args.out:
        args.out.write_text(json.dumps({"results": results, **provenance(load)}, indent=2))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
