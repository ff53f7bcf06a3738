"""The suite compiles at LLVM optimization level 0 (``tests/conftest.py``); users run XLA's
default, level 3. Level 0 changes how XLA:CPU's kernels are optimized by LLVM, not what they
compute (the HLO programs, their fusion and reduction orders are the same, and LLVM keeps IEEE
semantics without fast-math flags), so every test gives the same bits at both levels. This
module keeps that claim honest: it runs bit-exact tests of each layer (every code of the float
formats in every rounding mode, BFP / MX blocks with their special values, the flushed-subnormal
arithmetic of XLA:CPU, the exact float32 sum of the reductions, the exact block-dot definition,
PowerSGD's Gram-Schmidt and the PyTorch bridge) again at level 3, in a subprocess.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# whole test functions (every case), each comparing bit patterns with an oracle
AT_LEVEL_3 = (
    "tests/formats/test_float_format.py::test_preset_every_code_all_modes",
    "tests/formats/test_codes.py::test_codes_are_ml_dtypes_bit_patterns",
    "tests/formats/test_block.py::test_blockformat_negative_zero_and_nonfinite",
    "tests/formats/test_block.py::test_mx_against_numpy",
    "tests/formats/test_mx_fast_path.py::test_element_paths_match_the_scaled_rounding",
    "tests/cli/test_portable.py::test_mul_and_add_are_ieee_with_flushed_subnormals_and_one_nan",
    "tests/parallel/test_psum.py::test_add_f32_is_ieee_with_subnormals",
    "tests/parallel/test_psum.py::test_shard_map_8_devices",
    "tests/ops/test_block_dot.py::test_reference_is_the_definition",
    "tests/parallel/compress/test_lowrank_fast_paths.py::test_gram_schmidt_matches_the_oracle",
    "tests/torch_bridge/test_torch_bridge.py::test_same_bits_as_jax",
)


def test_the_suite_compiles_at_level_0_unless_xla_flags_names_a_level():
  flags = os.environ["XLA_FLAGS"].split()
  levels = [f for f in flags if f.startswith("--xla_backend_optimization_level=")]
  assert levels, flags
  assert "--xla_force_host_platform_device_count=8" in flags


def test_bit_exact_tests_pass_at_xla_default_optimization_level():
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=3"
  env.pop("PYTEST_XDIST_WORKER", None)
  env.pop("PYTEST_ADDOPTS", None)
  r = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-x", *AT_LEVEL_3],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  tail = (r.stdout + r.stderr)[-4000:]
  assert r.returncode == 0, tail
  assert " passed" in tail and "failed" not in tail, tail


@pytest.mark.parametrize("name", AT_LEVEL_3)
def test_each_listed_test_exists(name):
  path, _, function = name.partition("::")
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    assert f"def {function}(" in f.read(), name
