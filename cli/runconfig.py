"""A run directory's config: the resolved ``config.toml`` written before a job starts, what
it records, and the rule that a run directory holds one run.

``config.toml`` is the job as it ran: the file, the command line's overrides and every
default, with each path made absolute (paths in a config are relative to its file's folder;
a shipped model's name stays a name), so ``pivot run RUN_DIR/config.toml`` runs the same job
from anywhere. Its header comments name the source file and the overrides, one per line.

    flag_overrides(seed=3, deployment="pivot") -> ["seed=3", "deployment.kind=pivot"]
    resolved_config(job, config_path) -> JobConfig                 (paths absolute)
    write_run_config(run_dir, job, config_path, overrides) -> Path  (RUN_DIR/config.toml)
    read_header(path) -> RunConfigHeader(source, overrides)
    existing_run(run_dir) -> [file names];  refuse_existing_run(run_dir)  raises ConfigError
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import msgspec

from pivot.assets import ASSETS
from pivot.config import ConfigError, to_toml
from pivot.job import JobConfig

CONFIG_NAME = "config.toml"
#: What `pivot run` runs without a config named.
DEFAULT_CONFIG = "configs/tiny.toml"
#: What a run leaves in its directory; any of them there means the directory holds a run.
RUN_FILES = (
    CONFIG_NAME,
    "metrics.jsonl",
    "timeline.jsonl",
    "samples.jsonl",
    "shift.journal",
    "actors.log",
    "tensorboard",
    "summary.json",
)
_SOURCE = "source: "
_OVERRIDE = "override: "


class RunConfigHeader(NamedTuple):
    """What a config.toml's header says of where it came from."""

    source: str  # the config file given to `pivot run`, absolute
    overrides: list[str]  # key=value, as given (the flags' ones last)


def flag_overrides(
    *, seed: int | None = None, deployment: str | None = None, steps: int | None = None
) -> list[str]:
    """The `pivot run` flags that set a config key, as the overrides they are."""
    out = []
    if seed is not None:
        out.append(f"seed={seed}")
    if deployment is not None:
        out.append(f"deployment.kind={deployment}")
    if steps is not None:
        out.append(f"steps={steps}")
    return out


def _absolute(base: Path, value: str) -> str:
    return str((base / value).resolve()) if value else value


def _model(base: Path, name: str) -> str:
    # `resolve_model` looks among the shipped models first: a name found there stays a name
    return name if (ASSETS / name / "config.json").is_file() else _absolute(base, name)


def _function(base: Path, spec: str) -> str:
    module, colon, attr = spec.rpartition(":")
    if colon and module.endswith(".py"):
        return f"{_absolute(base, module)}:{attr}"
    return spec  # "package.module:name" is imported, not a path


def resolved_config(job: JobConfig, config_path: str | Path) -> JobConfig:
    """``job`` (read from ``config_path``) with every path absolute, so that it means the
    same files wherever its TOML is written."""
    base = Path(config_path).parent
    replace = msgspec.structs.replace
    m, d, r = job.model, job.data, job.reward
    return replace(
        job,
        model=replace(m, policy=_model(base, m.policy), genrm=_model(base, m.genrm)),
        data=replace(d, train=_absolute(base, d.train), eval=_absolute(base, d.eval)),
        reward=replace(
            r,
            function=_function(base, r.function),
            checker=_function(base, r.checker),
            verdict=_function(base, r.verdict),
            template=_absolute(base, r.template),
        ),
    )


def write_run_config(
    run_dir: Path,
    job: JobConfig,
    config_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    source: str | Path | None = None,
) -> Path:
    """``RUN_DIR/config.toml``: ``job`` resolved, under a header naming its source (default
    ``config_path``; a resumed run keeps its first source) and the overrides given."""
    header = [
        "The resolved config of this run: the source file, the overrides and every default,",
        "paths absolute. `pivot run` of this file runs the same job.",
        _SOURCE + str(Path(source or config_path).resolve()),
        *(_OVERRIDE + o for o in overrides),
    ]
    path = run_dir / CONFIG_NAME
    path.write_text(to_toml(resolved_config(job, config_path), "\n".join(header)), "utf-8")
    return path


def read_header(path: str | Path) -> RunConfigHeader:
    """The source and overrides a config.toml written by ``write_run_config`` records."""
    source, overrides = "", []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if text.startswith(_SOURCE):
            source = text[len(_SOURCE) :]
        elif text.startswith(_OVERRIDE):
            overrides.append(text[len(_OVERRIDE) :])
    return RunConfigHeader(source, overrides)


def existing_run(run_dir: Path) -> list[str]:
    """The run files already in ``run_dir`` (none: a new or empty directory)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def refuse_existing_run(run_dir: Path) -> None:
    """A run directory holds one run: starting another there would mix their records."""
    found = existing_run(run_dir)
    if found:
        raise ConfigError(
            str(run_dir),
            "",
            "a run directory without a run (use --resume RUN_DIR to continue it, "
            "or another --run-dir)",
            f"a run already there ({', '.join(found)})",
        )
