"""jaxport's argparse parser: every refusal one line, with the fix.

Shared by the top-level command line (`jaxport._cli`) and `jaxport train` (`jaxport.train._cli`).
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from ._args import closest, one_of
from ._errors import ConfigError


def shown(text: str) -> str:
    """A value as the user typed it: a number plainly (1.5), anything else quoted ('', 'abc')."""
    try:
        float(text)
    except ValueError:
        return repr(text)
    return text


class Parser(argparse.ArgumentParser):
    """jaxport's parsers (argparse builds each command's with the top-level parser's class): every
    refusal is one line, `jaxport: error: ...`, exit status 2, as a refusal of the settings
    themselves is. argparse printed its whole usage block first, named no fix for a misspelt
    choice or command, and left a command's unknown flags to the top-level parser, which could not
    suggest the flag meant."""

    _given: Sequence[str] = ()  # the arguments of the latest parse, for `_first_unknown_flag`

    def error(self, message: str):
        if message.startswith("the following arguments are required"):
            # A misspelt flag is the likelier fix: `--wrokdir w` leaves --workdir missing.
            message = self._first_unknown_flag() or message
        # A message already written as "`--flag` (=value) ..." would say the flag twice after
        # argparse's "argument --flag: "; argparse's own words get a pointer to the help.
        message = re.sub(r"^argument [^:]+: (?=`)", "", message)
        switch = re.fullmatch(r"argument (\S+): ignored explicit argument (.*)", message)
        if switch:  # `--force=yes`: argparse's words did not say that the flag alone is the "yes"
            flag, value = switch.groups()
            message = f"`{flag}` (={value}) takes no value: pass {flag} alone to turn it on, or leave it out"
        if not message.startswith("`"):
            message += f"; see `{self.prog} --help`"
        self.exit(2, f"jaxport: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self._unknown(extras))
        # The command is checked here, not by argparse (`required=True`), so that a flag before
        # it (`jaxport --debug`) is named as unknown rather than the command as missing.
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(namespace, action.dest) is None:
                self.error(f"`{self.prog}` needs a command: {', '.join(action.choices)}; e.g. "
                           f"`{self.prog} {next(iter(action.choices))} --help`")
        return namespace, extras

    def _check_value(self, action, value):
        # argparse's "invalid choice: 'resnet5' (choose from 'auto', 'resnet18', ...)" named no fix.
        if action.choices is None or value in action.choices:
            return
        if not action.option_strings:  # the command
            guess = closest(value, list(action.choices))
            fix = f"did you mean `{self.prog} {guess}`?" if guess else f"see `{self.prog} --help`"
            raise argparse.ArgumentError(None, f"`{value}` is not a `{self.prog}` command (one of "
                                               f"{', '.join(action.choices)}); {fix}")
        try:
            one_of(action.option_strings[-1], value, list(action.choices), aliases=getattr(action, "aliases", None))
        except ConfigError as e:
            raise argparse.ArgumentError(None, str(e)) from None

    def _first_unknown_flag(self) -> str | None:
        """The line for the first flag given that is none of this parser's, nor a prefix of one."""
        for arg in self._given:
            if arg == "--":  # the rest are positional arguments
                return None
            flag = arg.partition("=")[0]
            if flag.startswith("--") and not any(s.startswith(flag) for s in self._option_string_actions):
                return self._unknown([arg])
        return None

    def _unknown(self, extras: list[str]) -> str:
        """The line for the first argument nothing took: the flag meant, if one is close."""
        first = extras[0]
        if not first.startswith("-"):
            names = [a.metavar or a.dest for a in self._actions if not a.option_strings]
            if not names:
                return f"`{self.prog}` takes no positional arguments (got {first!r}); see `{self.prog} --help`"
            return (f"`{self.prog}` takes at most {len(names)} positional argument{'s' * (len(names) > 1)} "
                    f"({', '.join(names)}), so {first!r} is one too many; see `{self.prog} --help`")
        flag = first.partition("=")[0]
        guess = closest(flag, [s for s in self._option_string_actions if s.startswith("--")])
        fix = f"did you mean {guess}?" if guess else f"see `{self.prog} --help` for the flags"
        return f"`{flag}` is not a `{self.prog}` flag; {fix}"
