"""The ``jaxlp`` command's entry point: Ctrl-C while it starts ends with one line.

Importing JAX takes a second or two, and a SIGINT in the middle of it can interrupt a C
extension's initialisation (a KeyboardInterrupt traceback, an ImportError or an abort instead
of one line). So SIGINT is held while :mod:`jaxlp.cli` and its dependencies load; if one came,
the command stops before doing anything with one line and the shell's status 130. Once loaded,
the command's own handling of Ctrl-C applies (see :func:`jaxlp.cli.main`).
"""

from __future__ import annotations

import signal
import sys


def main(argv=None) -> int:
  """Load :mod:`jaxlp.cli` with SIGINT held, then run its ``main(argv)``."""
  got = []
  try:
    previous, held = signal.signal(signal.SIGINT, lambda *_: got.append(True)), True
  except ValueError:  # not the main thread: nothing to hold
    previous, held = None, False
  try:
    from jaxlp.cli import main as cli_main  # noqa: PLC0415 (the point of this module)
  finally:
    if held:
      signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
  if got:
    print("jaxlp: interrupted while starting; nothing was run or written", file=sys.stderr)
    return 130
  return cli_main(argv)
