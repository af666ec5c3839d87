"""The start-up checks: every name a config refers to and every path it reads or writes, checked before
any model loads, Ray starts a worker or a run folder is written.

A setup mistake (a misspelt env, task, suite, tool, grader or family; an option the env does not take; a
missing, truncated or unwritable file) then ends the command in one line that names the key, what is
wrong and what to do, with a close match where there is one, and exit code 2, instead of a traceback
from deep inside the run minutes later. Each check reads a registry the run itself uses, so a name
registered there passes here. Last, what a run asks Ray for is held against what its cluster has: a
request no cluster placement can meet stops the run at once (a `ResourceError`), not after a long wait.
"""

from __future__ import annotations

import inspect
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from mmrl.config import Config, ToolConfig
from mmrl.errors import ConfigError, unknown_name


def check_startup(cfg: Config, command: str) -> None:
    """Everything `command` (train, eval or sft) will name or touch, checked in the order a run meets it."""
    check_device(cfg.trainer.device)
    check_algorithm_files(cfg)
    if command == "sft":
        key, path = "sft.base_model", cfg.sft.base_model if cfg.sft else cfg.model.path
        check_turns(cfg, key, check_model(key, path))
        check_writable("model.path", cfg.model.path)
    elif command == "train":
        if not (Path(cfg.model.path) / "config.json").exists() and cfg.sft is not None:
            raise ConfigError(
                f"model.path: no model at {cfg.model.path}; this config starts from behaviour cloning, so "
                "run `mmrl sft` with it first (it writes model.path)"
            )
        family = check_model("model.path", cfg.model.path)
        check_second_models(cfg, family)
        check_turns(cfg, "model.path", family)
        settle_engine(cfg, family)
        from mmrl.workers.memory import refuse_what_cannot_fit

        refuse_what_cannot_fit(cfg)  # on GPUs: a run that cannot fit stops here, not in its first update
        check_action_head(cfg)
        check_writable("trainer.output_dir", cfg.trainer.output_dir)
    if cfg.env is not None:
        check_env("env.task", cfg.env.task, cfg.env.options)
    if cfg.agent is not None and cfg.agent.game is not None:
        check_env("agent.game.task", cfg.agent.game.task, cfg.agent.game.options, game=True)
    if cfg.agent is not None:
        check_tools(cfg.agent.tools)
    if command != "sft":
        for key in ("train_files", "val_files") if command == "train" else ("val_files",):
            for spec in getattr(cfg.data, key):
                check_data(f"data.{key}", spec)
    if cfg.env is None and command != "sft":  # env configs are scored by their environment
        from mmrl.sources.scoring import check_rewards

        check_rewards(cfg.reward)
    if command == "train":
        check_resources(cfg)


def check_algorithm_files(cfg: Config) -> None:
    """An algorithm given as `path/to/file.py:function` is imported now, so a missing file or function, or
    code that fails to import, is one line naming the key before any model loads."""
    from mmrl.algorithms import load_from_file

    named = {
        "algorithm.adv_estimator": cfg.algorithm.adv_estimator,
        "algorithm.policy_filtration": cfg.algorithm.policy_filtration,
        "actor.policy_loss": cfg.actor.policy_loss,
        "actor.rollout_correction": cfg.actor.rollout_correction,
    }
    for key, spec in named.items():
        if spec is None or ":" not in spec:
            continue
        try:
            load_from_file(spec)
        except Exception as err:  # user code: whatever it raises at import is the user's mistake
            raise ConfigError(f"{key}={spec}: {type(err).__name__}: {err}") from None


def check_device(device: str) -> None:
    """A CUDA device asked for where none is visible fails here, not as a torch assertion mid start-up."""
    import torch

    index = device.partition(":")[2]
    seen = torch.cuda.device_count()
    if device.startswith("cuda") and (int(index) if index.isdigit() else 0) >= seen:
        visible = f"only {seen} CUDA GPU(s) are" if seen else "no CUDA GPU is"
        raise ConfigError(
            f"trainer.device={device}, but {visible} visible to this process; use trainer.device=auto "
            "(the GPU when there is one, else the CPU) or trainer.device=cpu"
        )


def check_family(key: str, family: str) -> None:
    """A model family by its name (`mmrl model init-tiny --family`)."""
    from mmrl.models import FAMILIES

    names = {cls.name for cls in FAMILIES.values()}
    if family not in names:
        raise unknown_name(f"{key} {family!r} is not a model family mmrl knows", family, sorted(names))


def check_second_models(cfg: Config, family: Any) -> None:
    """`critic.model_path` and `prm.model_path`, where the algorithm trains that model: a whole model folder
    of the policy's family, since the critic's trunk and PRIME's PRM read the policy's token rows and images
    as they are. Each error names its own key."""
    from mmrl.training.critic import needs_critic
    from mmrl.training.prm import needs_prm

    second = {
        "critic.model_path": (cfg.critic.model_path, needs_critic(cfg), "critic"),
        "prm.model_path": (cfg.prm.model_path, needs_prm(cfg), "PRM"),
    }
    for key, (path, trained, what) in second.items():
        if path is None or not trained:
            continue
        other = check_model(key, path)
        if other.name != family.name:
            raise ConfigError(
                f"{key}: {path} is a {other.name} model, but the policy (model.path) is {family.name}; the "
                f"{what} reads the policy's token rows and images, so start it from a {family.name} model with "
                f"the policy's tokenizer, or leave {key} unset (it then starts from the policy)"
            )


def check_turns(cfg: Config, key: str, family: Any) -> None:
    """Env and agent runs write observations and tool results as chat turns in Qwen's format with Qwen's
    image tokens (`processors.chat.user_turn_text`): a family whose template and tokens differ is refused."""
    kind = "env" if cfg.env is not None else "agent" if cfg.agent is not None else None
    if kind is not None and not family.qwen_turns:
        raise ConfigError(
            f"{key}: {family.name} models cannot run {kind} episodes yet: mmrl writes observations and tool "
            f"results as Qwen chat turns with Qwen's image tokens, which {family.name} reads otherwise; "
            f"use a Qwen-VL model for this config, or drop its `{kind}` section"
        )


def settle_engine(cfg: Config, family: Any) -> None:
    """`rollout.engine` for a family vLLM cannot serve yet (`Family.vllm_unsupported` says why): `auto`
    becomes `hf`, and `vllm` is refused in one line, instead of failing at the first batch."""
    if not family.vllm_unsupported or cfg.rollout.engine == "hf":
        return
    if cfg.rollout.engine == "vllm":
        raise ConfigError(
            f"rollout.engine=vllm: {family.name} models do not run on mmrl's vLLM engine yet "
            f"({family.vllm_unsupported}); set rollout.engine=hf"
        )
    cfg.rollout.engine = "hf"


def check_action_head(cfg: Config) -> None:
    """A policy with a continuous action head (`mmrl sft` with `sft.policy: gaussian`) trains full-weight in
    the trainer's process and samples from its own head; a setting that would take it elsewhere is refused
    in one line. `rollout.engine: auto` becomes `hf`, the only engine that runs the head. Both side files
    (the head's spec, an action-token policy's bins) are read here, so a damaged one is one line."""
    from mmrl.models import head_spec
    from mmrl.vla.sft import load_action_tokenizer

    load_action_tokenizer(cfg.model.path)  # a damaged one stops here, in one line, not at the first step
    if head_spec(cfg.model.path) is None:
        return
    refused = {
        "rollout.engine=vllm": cfg.rollout.engine == "vllm",
        "model.lora": bool(cfg.model.lora.rank),
        "FSDP workers (trainer.ray_address, trainer.n_gpus_per_node > 1)": cfg.trainer.uses_workers,
    }
    for setting, asked in refused.items():
        if asked:
            raise ConfigError(
                f"{setting}: {cfg.model.path} is a policy with a continuous action head, which trains in one "
                "process, full-weight, sampling from its own head; drop the setting, or clone a token policy "
                "(sft.policy: tokens)"
            )
    cfg.rollout.engine = "hf"


def check_model(key: str, path: str) -> Any:
    """A model folder: its config names a supported `model_type`, and its weight files are whole. A hub id
    is resolved (from the cache when offline) and checked the same way. Returns the family it is of."""
    from mmrl.models import FAMILIES
    from mmrl.models.loading import checked_folder

    try:
        folder = checked_folder(path)
    except FileNotFoundError as err:  # worded for model.path, the key most runs name their model by
        raise ConfigError(str(err).replace("model.path", key)) from None
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{key}: {folder / 'config.json'} is not a readable JSON object ({err})") from None
    if model_type not in FAMILIES:
        raise unknown_name(
            f"{key}: {folder / 'config.json'} has model_type {model_type!r}, which no supported family serves",
            str(model_type),
            sorted(FAMILIES),
            " (docs/adding_a_model.md adds a family)",
        )
    redo = "copy or download it again, or build a tiny one with `mmrl model init-tiny DIR`"
    index = folder / "model.safetensors.index.json"
    if index.is_file() and not (folder / "model.safetensors").is_file():  # transformers' order
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise ConfigError(f"{key}: {index} is not a readable weight index ({err}); {redo}") from None
        if missing := sorted(name for name in shards if not (folder / name).is_file()):
            raise ConfigError(
                f"{key}: {folder} lacks weight files its index names: {', '.join(missing)}; {redo}"
            )
    for weights in sorted(folder.glob("*.safetensors")):
        if problem := safetensors_problem(weights):
            raise ConfigError(
                f"{key}: {weights} is {problem}: it was cut short or damaged (a copy or download that did "
                f"not finish?); {redo}"
            )
    return FAMILIES[model_type]


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be whole (its header's tensors must end where the file does), or None.
    Reads the header only."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes long, shorter than a safetensors header"
        length = struct.unpack("<Q", head)[0]
        if 8 + length > size:
            return f"{size} bytes long, shorter than the {length}-byte header it announces"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return "not a safetensors file (its header is not one)"
    if 8 + length + end != size:
        return f"{size} bytes long where its header says {8 + length + end}"
    return None


def check_env(key: str, task: str, options: dict[str, Any], game: bool = False) -> None:
    """A registered env, a task its family knows, and options its factory takes; a game's env names its
    moves. No env is built."""
    from mmrl.envs import registered_envs
    from mmrl.envs.registry import env_factory

    try:
        factory, family_task = env_factory(task)
    except KeyError:
        raise unknown_name(
            f"{key}={task!r} is not a registered env",
            task,
            registered_envs(),
            " (envs.register_env adds one)",
        ) from None
    except ImportError as err:
        raise ConfigError(f"{key}: {err}") from None
    known = getattr(factory, "task_names", ())
    if family_task is not None and known and family_task not in known:
        family = task[: len(task) - len(family_task)]
        raise unknown_name(f"{key}={task!r}: {family} has no task {family_task!r}", family_task, known)
    if game and not getattr(factory, "words", None):
        raise ConfigError(
            f"{key}={task!r} names no moves (`Env.words`), so a language policy cannot play it turn by turn; "
            "play an env that does (gridnav), or train this one as a VLA policy (an `env` section, no "
            "`agent.game`)"
        )
    signature = inspect.signature(factory)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    accepted = [name for name in signature.parameters if name != "task" or family_task is None]
    for option in options:
        if option not in accepted and not takes_any:
            raise unknown_name(
                f"{key.rpartition('.')[0]}.options: env {task!r} takes no option {option!r}", option, accepted
            )


def check_tools(tools: list[ToolConfig]) -> None:
    """Each tool is a built-in or a file's function, which must come with the JSON schema of its arguments."""
    from mmrl.agent.builtin import BUILTIN_TOOLS
    from mmrl.rewards.loader import load_file_function

    for i, tool in enumerate(tools):
        key = f"agent.tools[{i}].function"
        if tool.function in BUILTIN_TOOLS:
            continue
        if ":" not in tool.function:
            raise unknown_name(
                f"{key}={tool.function!r} is not a built-in tool",
                tool.function,
                BUILTIN_TOOLS,
                "; a function of your own is named path/to/file.py:function, with its `parameters`",
            )
        if tool.parameters is None:
            raise ConfigError(
                f"agent.tools[{i}] ({tool.function}) has no `parameters`: give the JSON schema of its "
                "arguments, e.g. parameters: {type: object, properties: {query: {type: string}}}"
            )
        try:
            load_file_function(tool.function, "tool")
        except (ValueError, ImportError, AttributeError, FileNotFoundError) as err:
            raise ConfigError(f"{key}: {err}") from None


def check_data(key: str, spec: str) -> None:
    """A data file, folder or hub id that resolves, and whose parquet files are parquet."""
    from mmrl.data.rows import resolve_data

    try:
        source = resolve_data(spec)  # FOLDER@SPLIT and hub-cache names too, not only plain paths
    except (FileNotFoundError, ConfigError) as err:
        raise ConfigError(f"{key}: {err}") from None
    for path in source.files:
        if not path.is_file():
            raise ConfigError(f"{key}: {path} is not a file; give a data file or a dataset folder")
        try:
            with path.open("rb") as f:
                head = f.read(4)
                f.seek(max(path.stat().st_size - 4, 0))
                tail = f.read(4)
        except OSError as err:
            raise ConfigError(
                f"{key}: {path} cannot be read ({err.strerror}); check its permissions"
            ) from None
        if path.suffix != ".parquet":
            continue
        if not head:
            raise ConfigError(f"{key}: {path} is empty (0 bytes); write the parquet file again")
        if head != b"PAR1" or tail != b"PAR1":
            raise ConfigError(
                f"{key}: {path} is not a parquet file, or was cut short (it does not begin and end with "
                "parquet's PAR1 marker); write it again, or give jsonl"
            )


def check_writable(key: str, folder: str) -> None:
    """A folder the command writes into: a folder if it exists, else made under its nearest existing
    parent. Tried by making (and removing) an empty folder there, as permission bits do not tell a
    read-only mount, or what root may not write, from a writable place."""
    path = Path(folder).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={folder}: {path} is a file; give a folder to write into")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}={folder}: {existing} is a file, so no folder can be made under it")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mmrl_write_check_", dir=existing))
    except OSError as err:
        raise ConfigError(
            f"{key}={folder}: nothing can be written in {existing} ({err.strerror}); give a folder you can "
            "write in"
        ) from None


def check_resources(cfg: Config) -> None:
    """What the run will ask Ray for, against what the cluster has (a local one: this machine), so a
    request that can never be met fails now instead of after minutes of waiting."""
    from mmrl.workers.cluster import Request

    requests = []
    if cfg.trainer.uses_workers:
        t = cfg.trainer
        setting = f"trainer.nnodes x trainer.n_gpus_per_node={t.world_size}"
        requests.append(Request(setting, t.world_size, t.cpus_per_worker, gpu=True))
    if cfg.rollout.remote:
        r = cfg.rollout
        requests.append(
            Request(
                f"rollout.workers={r.workers} x rollout.worker_cpus={r.worker_cpus}",
                r.workers,
                r.worker_cpus,
                True,
            )
        )
    if cfg.env is not None and cfg.env.num_workers:
        from mmrl.sources.episodes import env_workers, train_env_count

        workers = env_workers(cfg, train_env_count(cfg))
        requests.append(Request(f"env.num_workers={cfg.env.num_workers}", workers, 1.0))
    if not requests:
        return
    from mmrl.workers.cluster import check_capacity, connect

    connect(cfg.trainer.ray_address)
    check_capacity(requests)
