"""Command-line parsing that answers an unknown or misspelt flag with the flag that was meant.

argparse rejects ``rdzv run --nproc-per-nod 2`` with only "unrecognized arguments". The parsers
here add "did you mean --nproc-per-node?" (a close spelling, or the flags that start with what was
typed), and :func:`parse_command_line` makes the sub-command that was given, not the top-level
``rdzv`` parser, report its unknown flags, with its own usage and its own flags as suggestions.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn, Sequence

UNRECOGNIZED = "unrecognized arguments: "
"""How argparse's message about unknown arguments starts."""
MOST_SUGGESTED = 3
"""At most this many flags starting alike are suggested for one unknown flag."""
MIN_PREFIX = 4
"""A typed flag longer than this (dashes included) is matched as the start of longer flags."""
CLOSENESS = 0.7
"""How alike (difflib's ratio, 0..1) a known flag must be to an unknown one to be suggested."""


class HintingParser(argparse.ArgumentParser):
    """An ArgumentParser whose 'unrecognized arguments' error suggests the flags meant.

    ``unknown_note`` is added to that error when some unknown flag resembles none of the known
    ones (e.g. where the arguments of a training script go).
    """

    def __init__(self, *args: Any, unknown_note: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unknown_note = unknown_note

    def error(self, message: str) -> NoReturn:
        if message.startswith(UNRECOGNIZED):
            message += self._hint(message[len(UNRECOGNIZED):].split())
        super().error(message)

    def known_flags(self) -> list[str]:
        """Every long flag (``--name``) this parser accepts."""
        return [flag for action in self._actions for flag in action.option_strings
                if flag.startswith("--")]

    def _hint(self, tokens: list[str]) -> str:
        """What to add to the error about ``tokens``: the flags meant, and maybe the note."""
        # tokens not starting with '-' are values of unknown flags or stray arguments
        names = [token.split("=", 1)[0] for token in tokens if token.startswith("-")]
        known = self.known_flags()
        hints, unmatched = [], False
        for name in names:
            meant = " or ".join(flags_meant(name, known))
            if meant:
                hints.append(f"{meant} for {name}" if len(names) > 1 else meant)
            unmatched = unmatched or not meant
        text = f"; did you mean {', '.join(hints)}?" if hints else ""
        if unmatched and self.unknown_note:
            text += f"; {self.unknown_note}"
        return text


def flags_meant(name: str, known: list[str]) -> list[str]:
    """The flags of ``known`` that the unknown flag ``name`` most likely stands for (maybe none).

    Tried in turn: the same flag but for its dashes (``-nnodes``, ``--nproc-per_node``); the
    flags that start with what was typed (``--nproc``), or with all of it but its last letter
    (``--nprocs``); the one flag spelt most alike, if close enough (``--rdzv-backnd``). ``_``
    and ``-`` count as the same; of two spellings of one flag, the one ``name`` mostly resembles.
    """
    typed = _form("--" + name.lstrip("-"))
    wants_underscores = name.count("_") > name.lstrip("-").count("-")
    by_form: dict[str, str] = {}
    for flag in known:
        if _form(flag) not in by_form or ("_" in flag) == wants_underscores:
            by_form[_form(flag)] = flag
    if typed in by_form:
        return [by_form[typed]]
    for prefix in (typed, typed[:-1]):
        starting = sorted(flag for form, flag in by_form.items()
                          if len(prefix) > MIN_PREFIX and form.startswith(prefix))
        if starting:
            return starting[:MOST_SUGGESTED]
    return [by_form[form] for form in difflib.get_close_matches(typed, list(by_form), 1,
                                                                CLOSENESS)]


def _form(flag: str) -> str:
    return flag.replace("_", "-")


def parse_command_line(parser: argparse.ArgumentParser,
                       argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but unknown flags are reported by the sub-command's parser."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command_parser = _sub_command_parser(parser, getattr(args, "command", None)) or parser
        command_parser.error(UNRECOGNIZED + " ".join(unknown))
    return args


def _sub_command_parser(parser: argparse.ArgumentParser,
                        command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None
