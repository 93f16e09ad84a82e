"""Every flag and argument of every command-line entry point has a help text, and
``irdmafs --help`` lists each subcommand with a one-line description."""

import argparse

import pytest

from irdmafs.launch import cli, mount_helper
from irdmafs.server import node


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def built_parser(main, monkeypatch) -> argparse.ArgumentParser:
    """The parser an entry point's ``main`` builds, caught where it would parse."""

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed) as caught:
        main([])
    return caught.value.parser


def undocumented(ap: argparse.ArgumentParser, prefix: str) -> list[str]:
    missing = []
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += undocumented(sub, f"{prefix} {name}")
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{prefix} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_irdmafs_flag_has_a_help_text():
    assert undocumented(cli.parser(), "irdmafs") == []


@pytest.mark.parametrize("main, prog", [(node.main, "irdmafs-node"), (mount_helper.main, "mount.irdmafs")])
def test_every_flag_of_the_other_entry_points_has_a_help_text(main, prog, monkeypatch):
    assert undocumented(built_parser(main, monkeypatch), prog) == []


def test_irdmafs_help_lists_every_subcommand_with_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # a terminal's width: each command's line fits
    ap = cli.parser()
    [subs] = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    described = {c.dest: c.help for c in subs._choices_actions}
    assert set(described) == set(subs.choices)
    for name, text in described.items():
        assert text and "\n" not in text, name
    with pytest.raises(SystemExit):
        ap.parse_args(["--help"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name, text in described.items():
        assert any(ln.split() == [name, *text.split()] for ln in lines), (name, out)


def test_a_command_whose_reader_went_away_exits_quietly(tmp_path):
    """``irdmafs status | head -n 1``: the pipe's reader gone is no traceback (issue 44); the
    exit code is a shell's for a tool that SIGPIPE ended."""
    import subprocess
    import sys

    from irdmafs.launch.local import write_config

    cfg = write_config(tmp_path, 3, 2, coordinator=["http://127.0.0.1:9"])
    proc = subprocess.Popen([sys.executable, "-m", "irdmafs", "status", "--config", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
