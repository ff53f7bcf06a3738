"""Ctrl-C while the ``jaxlp`` command is still loading JAX ends with one line (issue 49)."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A SIGINT delivered in the middle of importing jaxlp.cli (and so JAX): deterministic, where a
# timed signal from outside would depend on the machine's speed.
_SCRIPT = textwrap.dedent("""
    import os, signal, sys

    class Interrupt:
      def find_spec(self, name, path=None, target=None):
        if name == "jaxlp.training":
          os.kill(os.getpid(), signal.SIGINT)
        return None

    sys.meta_path.insert(0, Interrupt())
    from jaxlp._entry import main
    sys.exit(main(["train", "--epochs", "1"]))
""")


def test_ctrl_c_while_starting_is_one_line_and_status_130(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  p = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 130, p.stderr
  assert p.stderr.strip().splitlines() == [
      "jaxlp: interrupted while starting; nothing was run or written"], p.stderr
  assert os.listdir(tmp_path) == []


def test_import_jaxlp_does_not_load_jax():
  # what lets the command hold SIGINT before anything heavy loads; the public names still work
  code = ("import sys, jaxlp; assert 'jax' not in sys.modules, 'jax loaded'; "
          "assert jaxlp.DotPolicy.__name__ == 'DotPolicy' and 'matmul' in dir(jaxlp)")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
