"""Test configuration: 8 forced CPU devices (set before jax is imported).

On a GPU machine (``JAX_PLATFORMS=cuda,cpu``) the default backend is the GPU and
``jax.devices()`` lists only it; the 8 forced CPU devices are still there as
``jax.devices("cpu")``. Tests that need several devices take them from there (see the
``cpu_devices`` fixture) instead of from ``jax.devices()``.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, shared by the pytest-xdist workers and
# the subprocesses the tests start (jaxlp train, examples, benchmarks, multi-process jobs): a
# program that several processes compile is compiled once. Created by the first process that
# loads this file (the xdist controller, before it starts the workers) and removed when that
# process exits; a cache directory given in the environment is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="jaxlp-tests-jit-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

N_CPU_DEVICES = 8


@pytest.fixture
def cpu_devices():
  """The forced CPU devices, with JAX's default device pinned to the first of them.

  For tests that compare a multi-device run (a mesh or pmap over these CPU devices) with a
  single-device run bit for bit: with the default device pinned, the single-device parts
  (vmap references, ``jnp`` inputs, eager ops) run on XLA:CPU as well, so one backend is
  compared with itself whatever the default backend is. On a CPU-only run this changes
  nothing (CPU device 0 already is the default device).
  """
  devs = jax.devices("cpu")
  if len(devs) < N_CPU_DEVICES:
    pytest.fail(f"tests/conftest.py forces {N_CPU_DEVICES} CPU devices but jax.devices('cpu') "
                f"has {len(devs)} (was jax initialised before XLA_FLAGS was set?)")
  with jax.default_device(devs[0]):
    yield devs


# Tests whose longest case took 12 s or more in a full run on the 2-core CI VM (2026-11-28,
# ``-n 2``), longest first. They are moved to the front of the run, so that pytest-xdist hands
# them out first and the two workers finish together (longest-first scheduling): in that run
# one worker was idle for the last 50 s while the other ran a 53 s test. Only the order
# changes; a name that no longer exists is ignored, and a new slow test left off the list only
# costs balance.
_SCHEDULE_FIRST = (
    "tests/parallel/compress/test_compress_multiprocess.py::test_multiprocess_matches_in_process_shard_map",
    "tests/torch_bridge/test_torch_triton.py::test_every_kernel_matches_the_spec_in_the_interpreter",
    "tests/torch_bridge/test_torch_ddp.py::test_parameters_identical_across_ranks_and_close",
    "tests/formats/test_qtorch_parity.py::test_float_quantize_nearest_parity",
    "tests/test_exact_train_check.py::test_two_cpu_runs_agree_and_a_changed_run_differs",
    "tests/cli/test_exact_blocks.py::test_mlp_exact_blocks_matches_the_emulation_on_the_toy_run",
    "tests/examples/test_examples.py::test_example_smoke",
    "tests/cli/test_exact_blocks.py::test_cnn_exact_blocks_runs_is_recorded_and_resume_checks_it",
    "tests/cli/test_reproduce.py::test_every_claim_runs_at_toy_size",
    "tests/test_loopback_bench_smoke.py::test_loopback_smoke",
    "tests/test_sharded_bench_smoke.py::test_sharded_bench_smoke",
    "tests/cli/test_shard.py::test_two_processes_over_jax_distributed",
    "tests/cli/test_shard.py::test_wire_flags_change_the_result_and_are_reported",
    "tests/parallel/test_fsdp.py::test_user_shard_map_over_devices_times_vmap_equals_vmap",
    "tests/test_compressors_bench_smoke.py::test_compressors_bench_small",
    "tests/parallel/compress/test_compress_allreduce.py::test_identical_on_workers_and_vmap_equals_shard_map",
    "tests/parallel/compress/test_compress_allreduce.py::test_pmap_equals_vmap",
    "tests/parallel/compress/test_engine_training.py::test_train_reduction_has_the_same_bits_on_1_and_4_devices",
    "tests/parallel/compress/test_compress_allreduce.py::test_powersgd_bucket_fusion_same_bits_fewer_collectives",
    "tests/cli/test_portable.py::test_portable_run_with_workers_schedule_and_decay_agrees_with_optax_closely",
    "tests/test_block_gemm_bench_smoke.py::test_block_gemm_bench_small",
    "tests/test_sparse_select_bench_smoke.py::test_sparse_select_bench_small",
    "tests/parallel/compress/test_speed_sparse.py::test_selection_equals_full_top_k",
    "tests/parallel/compress/test_compress_allreduce.py::test_allgather_fusion_and_plan",
    "tests/test_reduce_bench_smoke.py::test_reduce_benchmark_small",
    "tests/parallel/compress/test_speed_sparse.py::test_sparsifiers_under_vmap_match_per_worker",
    "tests/test_readme.py::test_readme_python_snippets_run",
    "tests/test_kernels_bench_smoke.py::test_kernels_check_interpreted_is_bit_exact",
    "tests/test_layers_bench_smoke.py::test_layers_benchmark_gpu_impl_times_each_exact_policy_with_each",
    "tests/parallel/compress/test_reduce_gradients_compressed.py::test_reduce_gradients_compressor_in_an_optax_chain",
    "tests/test_layers_bench_smoke.py::test_layers_benchmark_gemm_census",
    "tests/cli/test_cli.py::test_real_devices_equal_emulation",
    "tests/parallel/compress/test_compress_allreduce.py::test_ring_vmap_shard_map_and_mixed_axes_identical",
    "tests/test_block_gemm_bench_smoke.py::test_block_gemm_bench_tiles_flag",
    "tests/parallel/test_psum.py::test_stochastic_same_in_vmap_shard_map_and_oracle",
    "tests/cli/test_portable.py::test_the_exact_mlp_step_computes_its_portable_arithmetic_about_once",
    "tests/test_docs.py::test_api_reference_builds_without_warnings",
    "tests/formats/test_qtorch_parity.py::test_block_quantize_nearest_parity",
    "tests/parallel/test_dgc_stages.py::test_train_sends_the_target_bytes_after_the_warm_up",
    "tests/flax_integration/test_flax.py::test_resnet18_trains_under_hbfp",
    "tests/flax_integration/test_flax.py::test_injected_linen_equals_injected_nnx_bit_for_bit",
)


def pytest_collection_modifyitems(config, items):
  """Runs the tests of :data:`_SCHEDULE_FIRST` first, in its order (a stable sort)."""
  del config
  rank = {name: i for i, name in enumerate(_SCHEDULE_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("[")[0], len(rank)))
