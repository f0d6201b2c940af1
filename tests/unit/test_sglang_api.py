"""The source-shape check (``scripts/check_sglang_api.py``) against the pinned SGLang wheel:
fetched once (no dependencies) into the wheel cache, then read without importing it."""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from pathlib import Path

import pytest

from pivot.actors import sglang_surface

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_sglang_api.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_sglang_api", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def source(checker):
    return checker.Source(checker.fetch_wheel())


def test_the_backend_surface_holds_against_the_pinned_wheel(checker, source):
    assert source.version() == sglang_surface.PIN
    assert checker.check(source) == []


def test_the_check_names_what_does_not_hold(checker, source):
    s = sglang_surface
    doctored = types.ModuleType("doctored")
    doctored.__dict__.update({k: v for k, v in vars(s).items() if k.isupper()})
    generate, abort = s.CALLS[1], s.CALLS[2]
    doctored.CALLS = (
        dataclasses.replace(generate, params=("obj",)),
        dataclasses.replace(abort, is_async=True),
        dataclasses.replace(abort, name="abort_requests"),
    )
    doctored.SERVER_ARGS = (*s.SERVER_ARGS, "tp_sise")
    doctored.REQUESTS = {**s.REQUESTS, "GenerateReqInput": ("input_idz",)}
    doctored.RESULT_KEYS = {generate.module: ("output_idz",)}
    doctored.ATTRIBUTES = {(generate.module, "TokenizerManager"): ("rid_to_statez",)}
    doctored.PAUSE_MODE = "freeze"
    assert checker.check(source, doctored) == [
        "TokenizerManager.generate_request: parameters ('obj', 'request'), the table has ('obj',)",
        "TokenizerManager.abort_request: is sync, the table says otherwise",
        "TokenizerManager.abort_requests: no such method on TokenizerManager or its bases",
        "GenerateReqInput: no fields ['input_idz']",
        "PauseGenerationReqInput offers no mode 'freeze'",
        "ServerArgs (sglang.srt.arg_groups.fields): no fields ['tp_sise']",
        "sglang.srt.managers.tokenizer_manager builds no keys ['output_idz']",
        "TokenizerManager assigns no attributes ['rid_to_statez']",
    ]


def test_a_missing_wheel_is_one_line_and_exit_2(checker, tmp_path, capsys):
    assert checker.main([str(tmp_path / "nothing.whl")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "nothing.whl: no such wheel or folder" in line


def test_the_gpu_extra_pins_the_version_the_table_is_written_against():
    import tomllib

    pyproject = tomllib.loads((SCRIPT.parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["gpu"] == [f"sglang=={sglang_surface.PIN}"]
