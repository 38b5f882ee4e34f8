"""The training commands' argument parser: bad arguments are one line on stderr and exit 2 (no
usage block, nothing written), as everywhere in swa-bench."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(2)
