"""The `pivot` command as a user meets it: help, version, and bad input named. Real jobs:
test_run.py. The process's own exit path (argparse, `sys.exit(main())`) is checked through a
real interpreter; bad input that the command names before any child starts is checked by
calling `main` in this process, the same code without an interpreter's start-up each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PIVOT = [sys.executable, "-m", "pivot.cli.main"]


def _pivot(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run([*PIVOT, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_help_and_version():
    out = _pivot("--help")
    assert out.returncode == 0
    for command in ("run", "bench", "version"):
        assert command in out.stdout
    out = _pivot("version")
    assert out.returncode == 0 and out.stdout.startswith("pivot ")


def test_bad_flag_and_bad_config_are_named(tmp_path, capsys):
    from pivot.cli.main import main

    out = _pivot("run", "--no-such-flag")
    assert out.returncode == 2 and "--no-such-flag" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = 3\n[cluster]\ndevices = 'four'\n")
    # a config error, through the real exit path
    out = _pivot("run", str(bad))
    assert out.returncode == 2
    assert f"{bad}: key 'cluster.devices': expected int, found str 'four'" in out.stderr
    missing_model = tmp_path / "m.toml"
    missing_model.write_text("[model]\npolicy = 'no-such-model'\n")
    assert main(["run", str(missing_model)]) == 2
    err = capsys.readouterr().err
    assert "model.policy" in err and "no-such-model" in err


def test_a_model_folder_pivot_cannot_serve_is_named_before_any_child_starts(tmp_path, capsys):
    import json
    import shutil

    from pivot.assets import ASSETS
    from pivot.cli.main import main

    unknown = tmp_path / "unknown"
    shutil.copytree(ASSETS / "tiny-policy", unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    garbled = tmp_path / "garbled"
    shutil.copytree(ASSETS / "tiny-policy", garbled)
    (garbled / "tokenizer.json").write_text("{not json")
    endless = tmp_path / "endless"  # a tokenizer without an eos token: generation never stops
    shutil.copytree(ASSETS / "tiny-policy", endless)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        specials = json.loads((endless / name).read_text())
        del specials["eos_token"]
        (endless / name).write_text(json.dumps(specials))
    corrupt = tmp_path / "corrupt"  # weights cut short, as by a failed copy
    shutil.copytree(ASSETS / "tiny-policy", corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    untokenized = tmp_path / "untokenized"
    shutil.copytree(ASSETS / "tiny-policy", untokenized)
    (untokenized / "tokenizer.json").unlink()
    unweighted = tmp_path / "unweighted"
    shutil.copytree(ASSETS / "tiny-policy", unweighted)
    (unweighted / "model.safetensors").unlink()
    cases = [
        (
            unknown,
            f"{unknown / 'config.json'}: key 'model_type': expected one of",
            "found 'no-such-model'",
        ),
        (
            garbled,
            f"{garbled / 'tokenizer.json'}: expected a tokenizer AutoTokenizer loads",
            "found JSONDecodeError",
        ),
        (
            endless,
            f"{endless / 'tokenizer_config.json'}: key 'eos_token': expected an eos token",
            "found none",
        ),
        (untokenized, f"{untokenized / 'tokenizer.json'}: expected a tokenizer", "found none"),
        (corrupt, f"{corrupt / 'model.safetensors'}: expected a safetensors file", "unreadable"),
        (unweighted, f"{unweighted}: expected model.safetensors", "found neither"),
    ]
    for folder, where, what in cases:
        job = tmp_path / f"{folder.name}.toml"
        job.write_text(f"[model]\npolicy = '{folder}'\n")
        run_dir = tmp_path / f"run-{folder.name}"
        code = main(["run", str(job), "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert code == 2, err
        [line] = err.splitlines()
        assert where in line and what in line, line
        assert not run_dir.exists()  # nothing started, nothing written


def test_bad_data_is_named_with_exit_code_2_before_any_child_starts(tmp_path, capsys):
    from pivot.cli.main import main

    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1="}\n{"prompt": "2+2="}\n')
    job = tmp_path / "job.toml"
    job.write_text("[data]\ntrain = 'train.jsonl'\nprompt_key = 'question'\n")
    run_dir = tmp_path / "run"
    code = main(["run", str(job), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = err.splitlines()
    assert f"{data}:2: key 'question': expected the prompt field (the record has prompt)" in line
    assert not run_dir.exists()


BAD_INPUTS = [
    # (config, files, what the one line says)
    ("[data]\ntrain = 'none.jsonl'", {}, "none.jsonl: expected an existing JSONL or Parquet file"),
    ("[data]\ntrain = 'd.jsonl'\nprompt_key = 'q'", {}, "d.jsonl:1: key 'q': expected the prompt"),
    ("[data]\ntrain = 'd.jsonl'\nreference_key = 'answer'", {}, "d.jsonl:1: key 'answer'"),
    ("[data]\neval = 'bad.jsonl'", {"bad.jsonl": "{oops\n"}, "bad.jsonl:1: expected one JSON"),
    ("[data]\neval_every = 2", {}, "key 'data.eval': expected an evaluation file"),
    (
        "[data]\ntrain = 'd.jsonl'\nepochs = 1\n[rollout]\nprompts_per_step = 5",
        {},
        "key 'data.epochs': expected enough records for one step of 5 prompts",
    ),
    ("[reward]\nkind = 'function'", {}, "key 'reward.function': expected a function name"),
    (
        "[reward]\nkind = 'function'\nfunction = 'r.py:missing'",
        {"r.py": "def score(s):\n    return 1.0\n"},
        "key 'reward.function': expected a function 'missing' in r.py",
    ),
    (
        "[reward]\nkind = 'function'\nfunction = 'no_such_pkg.mod:f'",
        {},
        "key 'reward.function': expected an importable module",
    ),
    ("[reward]\nfunction = 'r.py:score'", {}, "key 'reward.function': expected no value unless"),
    ("[reward]\nverdict = 'pivot.task:nope'", {}, "key 'reward.verdict': expected a function"),
    ("[reward]\ntemplate = 'j.j2'", {"j.j2": "{{ prompt }"}, "j.j2:1: expected a jinja2 template"),
    (
        "[reward]\ntemplate = 'j.j2'",
        {"j.j2": "{{ metadata.topic }}"},
        "key 'reward.template': expected j.j2 to render a record",
    ),
    (
        "[reward]\nsystem_prompt = 'judge'",
        {},
        "key 'reward.system_prompt': expected a GenRM whose tokenizer has a chat template",
    ),
    (
        "[data]\ntrain = 'd.jsonl'\n[reward]\nkind = 'exact'",
        {},
        "key 'reward.checker': expected a checker",
    ),
    # numbers that would run away or mean nothing
    ("[rollout]\ntemperature = inf", {}, "key 'rollout.temperature': expected a finite float"),
    ("[training]\nlr = nan", {}, "key 'training.lr': expected float > 0.0, found float nan"),
    ("steps = 100000000000000000000000", {}, "key 'steps': expected int <= 10000000"),
    ("[cluster]\ndevices = 4000", {}, "key 'cluster.devices': expected at most"),
    ("[rollout]\nmax_new_tokens = 5000", {}, "key 'rollout.max_new_tokens': expected fewer"),
]


def test_each_bad_input_is_one_line_naming_it(tmp_path, capsys):
    from pivot.cli.main import main

    for i, (config, files, expected) in enumerate(BAD_INPUTS):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "d.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
        for name, text in files.items():
            (folder / name).write_text(text)
        (folder / "job.toml").write_text(config + "\n")
        run_dir = folder / "run"
        code = main(["run", str(folder / "job.toml"), "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert code == 2, (config, err)
        [line] = err.splitlines()
        assert expected in line, (config, line)
        assert not run_dir.exists()


def test_a_bad_flag_value_a_directory_config_and_a_file_run_dir_are_one_line(tmp_path, capsys):
    from pivot.cli.main import main

    (tmp_path / "file").write_text("not a directory\n")
    cases = [
        (["run", "--seed", "-5"], "key 'seed': expected int >= 0, found int -5"),
        (["run", str(tmp_path)], f"{tmp_path}: expected a TOML file, found a directory"),
        (["run", "--run-dir", str(tmp_path / "file")], "key '--run-dir': expected a directory"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        [line] = capsys.readouterr().err.splitlines()
        assert expected in line, (argv, line)


def test_every_command_names_a_bad_flag_or_folder_in_one_line_before_it_runs(tmp_path, capsys):
    from pivot.cli.main import main

    repo = Path(__file__).resolve().parents[2]
    workload = str(repo / "configs/sim/qwen2.5-7b_qwen3-30b-a3b.toml")  # GenRM replicas of 4
    (tmp_path / "file").write_text("not a directory\n")
    unmakeable = tmp_path / "file" / "run"  # under a file: no folder can be made there
    simulated = tmp_path / "sim"
    recorded = tmp_path / "recorded"  # a run's events, for a screen this test has not
    recorded.mkdir()
    (recorded / "events.jsonl").write_text("")
    made = "expected a directory pivot can make, found NotADirectoryError"
    cases = [
        (["simulate", workload, "--interval", "0"], "argument --interval: must be > 0, not 0"),
        (["simulate", workload, "--horizon", "-5"], "argument --horizon: must be >= 0, not -5"),
        (["simulate", workload, "--horizon", "nan"], "--horizon: must be a finite number"),
        (["simulate", workload, "--seed", "-1"], "argument --seed: must be at least 0, not -1"),
        (
            ["simulate", workload, "--gpus", "6", "--run-dir", str(simulated)],
            "pivot simulate: --gpus 6: 6 devices are not a multiple of the replica size 4",
        ),
        (["simulate", workload, "--run-dir", str(unmakeable)], f"key '--run-dir': {made}"),
        (
            ["simulate", workload, "--ablation", "no-refit", "--deployment", "colocated"],
            "--ablation sets PivotRL's planner, and colocated runs no PivotRL",
        ),
        (
            ["simulate", workload, "--interval", "2", "--deployment", "disaggregated"],
            "--interval is the Controller's, and disaggregated runs no Controller",
        ),
        (
            ["simulate", workload, "--study", "horizon", "--horizon", "30"],
            "--horizon: --study horizon runs PivotRL at each H of 5..90 s itself",
        ),
        (["bench", "planner", "--sizes", "16", "6"], "--sizes: want a multiple of 4"),
        (["bench", "planner", "--repeats", "0"], "argument --repeats: must be at least 1"),
        (["bench", "gps", "--repeat", "0"], "argument --repeat: must be at least 1, not 0"),
        (["bench", "gps", "--threads", "0"], "argument --threads: must be at least 1"),
        (
            ["bench", "shift", "--run-dir", str(tmp_path / "file")],
            "key '--run-dir': expected a directory, found a file",
        ),
        (
            ["bench", "trainer", "--checkpoint", str(tmp_path)],
            f"{tmp_path}: expected a Hugging Face checkpoint folder, found no config.json",
        ),
        (["ps", "--root", str(tmp_path / "none")], f"--root {tmp_path / 'none'}: no such folder"),
        (["monitor", str(recorded)], f"{recorded}: needs a terminal (stdin and stdout)"),
        (["new-model", str(unmakeable), "--family", "qwen2"], f"key 'dir': {made}"),
        (["run", "--run-dir", str(unmakeable)], f"key '--run-dir': {made}"),
    ]
    for argv, expected in cases:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's exit, as the process would take it
            code = exc.code
        assert code == 2, argv
        [line] = capsys.readouterr().err.splitlines()
        assert expected in line, (argv, line)
    assert not simulated.exists()  # named before its run dir was made
