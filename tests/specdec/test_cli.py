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
