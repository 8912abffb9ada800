"""`moelens COMMAND --help` shows every option's default: its value, or in words what happens without it."""

import argparse

import pytest

from moelens.cli import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def optional(action: argparse.Action) -> bool:
    """An argument the user may leave out (not -h, not a flag, which is off unless given)."""
    return not (isinstance(action, argparse._HelpAction) or action.required or action.nargs == 0)


COMMANDS = subcommands()


def test_every_command_is_covered():
    assert set(COMMANDS) >= {"inspect", "verify", "plan", "trace", "trace-report"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_optional_argument_shows_its_default(command):
    parser = COMMANDS[command]
    formatter = parser._get_formatter()
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if optional(a) and "default" not in formatter._expand_help(a)
    ]
    assert not missing, f"moelens {command} --help shows no default for {missing}"


@pytest.mark.parametrize(
    "command, shown",
    [("inspect", "(default: float32)"), ("inspect", "(default: 5)"), ("verify", "(default: both)"),
     ("verify", "(default: 24)"), ("plan", "(default: bfloat16)"), ("plan", "(default: 2048)"),
     ("trace", "(default: 1024)")],
)
def test_values_are_shown_as_given(command, shown):
    text = " ".join(COMMANDS[command].format_help().split())  # unwrapped
    assert shown in text
