"""Every ``specdec`` subcommand answers --help (and exits 0) without loading models."""

import pytest

from specdec import cli


@pytest.mark.parametrize("argv", [[name, "--help"] for name in sorted(cli.SUBCOMMANDS)]
                         + [["eval", "apps", "--help"], ["eval", "humaneval", "--help"]])
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and argv[0] in out


def test_unknown_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


# --------------------------------------------------------------------------- one-line errors

_NO_MODEL = "/nonexistent/model-dir"  # never reached: argument checks come before any model load

BAD_ARGUMENTS = [
    (["generate", "hi", "--target", _NO_MODEL, "--tree-size", "-1"], "--tree-size", "expected 'auto' or an int >= 0, got -1"),
    (["generate", "hi", "--target", _NO_MODEL, "--max-new-tokens", "0"], "--max-new-tokens", "got 0"),
    (["generate", "hi", "--target", _NO_MODEL, "--temperature", "-1"], "--temperature", "got -1"),
    (["generate", "hi", "--target", _NO_MODEL, "--top-p", "2"], "--top-p", "(0, 1]"),
    (["generate", "hi", "--target", _NO_MODEL, "--top-p", "0"], "--top-p", "(0, 1]"),
    (["generate", "hi", "--target", _NO_MODEL, "--depth", "x"], "--depth", "'x'"),
    (["generate", "hi", "--target", _NO_MODEL, "--device", "tpu"], "--device", "expected cpu, cuda or cuda:N"),
    (["generate", "hi", "--drafter", "medusa", "--heads", "/nonexistent/heads"], "--heads", "no such file"),
    (["generate", "", "--target", _NO_MODEL], "prompt", "expected a non-empty text, got ''"),
    (["generate", "  \n", "--target", _NO_MODEL], "prompt", "expected a non-empty text"),
    (["eval", "apps", "--target", _NO_MODEL, "--out", "/proc/nope/o.jsonl"], "--out", "cannot write"),
    (["eval", "apps", "--target", _NO_MODEL, "--data", "/nonexistent/apps.jsonl"], "--data", "no such file"),
    (["eval", "apps", "--target", _NO_MODEL, "--problems", "-3"], "--problems", "got -3"),
    (["sweep", "--target", _NO_MODEL, "--tree-sizes", "32", "0"], "--tree-sizes", "got 0"),
    (["sweep", "--target", _NO_MODEL, "--temperature", "nan"], "--temperature", "got nan"),
    (["bench-engine", "--target", _NO_MODEL, "--reps", "0"], "--reps", "got 0"),
    (["bench-engine", "--target", _NO_MODEL, "--out", "/proc/nope/b.json"], "--out", "cannot write"),
    (["train-medusa", "--target", _NO_MODEL, "--out", "/proc/nope", "--steps", "5"], "--out", "cannot write"),
    (["train-medusa", "--target", _NO_MODEL, "--out", "x", "--lr", "0"], "--lr", "(0, inf)"),
    (["bench-attn", "--L", "0"], "--L", "expected an int >= 1"),
    (["bench-attn", "--heads", "6", "--kv-heads", "4"], "--heads", "multiple of --kv-heads"),
    (["models", "fetch", "no-such-model"], "name", "invalid choice"),
]


def _one_line_error(err: str, command: str, argument: str, detail: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    head, sep, _ = lines[0].partition(": error: ")
    assert sep and head.startswith(f"specdec {command}"), err  # 'specdec models fetch: error: ...' too
    assert argument in lines[0] and detail in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,argument,detail", BAD_ARGUMENTS, ids=[" ".join(a[:1] + a[-2:]) for a, _, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_errors(argv, argument, detail, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    _one_line_error(captured.err, argv[0], argument, detail)
    assert not (tmp_path / "x").exists() or argv[0] == "train-medusa"


BAD_DRAFTERS = [
    (["eval", "apps", "--drafters", "eagle:heads=/nonexistent"], "heads='/nonexistent'"),
    (["sweep", "--drafters", "lookup+eagle:heads=/nonexistent/h"], "is not an existing folder"),
    (["eval", "humaneval", "--drafters", "model:draft=/nonexistent/draft-dir"], "no such file or folder"),
]


@pytest.mark.parametrize("argv,detail", BAD_DRAFTERS, ids=[a[-1] for a, _ in BAD_DRAFTERS])
def test_bad_drafter_paths_fail_before_any_model_loads(argv, detail, capsys, tmp_path, monkeypatch):
    """Checked with the arguments: one line, exit 2, nothing downloaded or written (the default
    models are not in this empty cache, so loading one would start a download)."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    _one_line_error(capsys.readouterr().err, argv[0], "--drafters", detail)
    assert not home.exists() and list(tmp_path.iterdir()) == []


def test_cuda_device_without_cuda_is_a_one_line_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "hi", "--target", _NO_MODEL, "--device", "cuda"])
    assert exc.value.code == 2
    _one_line_error(capsys.readouterr().err, "generate", "--device", "no CUDA device is available")


def test_library_errors_are_one_line_and_debug_shows_the_traceback(capsys, tmp_path):
    """Errors found after parsing (here: a model directory that does not exist) are one line too."""
    argv = ["generate", "hi", "--target", str(tmp_path / "missing"), "--drafter", "lookup", "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("specdec generate: error: ") and "missing" in err
    with pytest.raises((ValueError, OSError)):
        cli.main(["--debug", *argv])
    with pytest.raises((ValueError, OSError)):
        cli.main([argv[0], "--debug", *argv[1:]])


def test_real_process_exit_status_and_stderr(tmp_path):
    """The installed entry point: exit status 2, one line on stderr, no traceback."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "eval", "apps", "--out", "/proc/nope/o.jsonl"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    _one_line_error(proc.stderr, "eval", "--out", "cannot write")


def test_bugs_keep_their_traceback():
    from specdec.cli import args as cliargs

    def handler(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        cliargs.run("specdec x", handler, [])
