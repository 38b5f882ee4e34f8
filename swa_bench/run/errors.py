"""What a command body refuses: one line for the user and the exit code it means.

The CLI maps these (and the scenario, results and run-folder errors) to one stderr line and an
exit code in one place (``cli._OneLineErrors``); a body raises them instead of printing.
"""

from __future__ import annotations


class CommandError(Exception):
    """Bad input or an output that cannot be written; ``str()`` is the line, ``code`` the exit
    code (2: the CLI's code for bad input)."""

    def __init__(self, line: str, code: int = 2) -> None:
        super().__init__(" ".join(line.split()))
        self.code = code
