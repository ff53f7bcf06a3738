"""jaxlp.parallel: low-precision, order-faithful gradient reduction, APS, node emulation,
sharded (FSDP / ZeRO) reduce-scatter and all-gather with specified bits.

Everything runs inside ``jax.pmap``, ``jax.shard_map`` and ``jax.vmap(axis_name=...)``.
"""

from jaxlp.parallel import compressors as compressors
from jaxlp.parallel._aps import format_emax as format_emax
from jaxlp.parallel._compressed import CompressionState as CompressionState
from jaxlp.parallel._compressed import compressed_allreduce as compressed_allreduce
from jaxlp.parallel._compressed import compressed_wire_bytes as compressed_wire_bytes
from jaxlp.parallel._compressed import init_compression_state as init_compression_state
from jaxlp.parallel._compressed import ordered_psum as ordered_psum
from jaxlp.parallel._distributed import initialize as initialize
from jaxlp.parallel._distributed import shutdown as shutdown
from jaxlp.parallel._emulate import emulate as emulate
from jaxlp.parallel._fsdp import ShardedOptimizer as ShardedOptimizer
from jaxlp.parallel._fsdp import ShardedOptState as ShardedOptState
from jaxlp.parallel._fsdp import sharded_optimizer as sharded_optimizer
from jaxlp.parallel._psum import ORDERS as ORDERS
from jaxlp.parallel._psum import payload_bytes as payload_bytes
from jaxlp.parallel._psum import psum as psum
from jaxlp.parallel._reduce import ReduceGradientsState as ReduceGradientsState
from jaxlp.parallel._reduce import compressed_optimizer as compressed_optimizer
from jaxlp.parallel._reduce import reduce_gradients as reduce_gradients
from jaxlp.parallel._secopa import HIPRESS_COSTS as HIPRESS_COSTS
from jaxlp.parallel._secopa import LinearCost as LinearCost
from jaxlp.parallel._secopa import PlanEntry as PlanEntry
from jaxlp.parallel._secopa import SeCoPaCosts as SeCoPaCosts
from jaxlp.parallel._secopa import hipress_costs as hipress_costs
from jaxlp.parallel._secopa import measure_costs as measure_costs
from jaxlp.parallel._secopa import secopa_plan as secopa_plan
from jaxlp.parallel._sharded import REDUCE_SCATTER_ORDERS as REDUCE_SCATTER_ORDERS
from jaxlp.parallel._sharded import all_gather as all_gather
from jaxlp.parallel._sharded import reduce_scatter as reduce_scatter
from jaxlp.parallel._sharded import wire_payload_bytes as wire_payload_bytes
from jaxlp.parallel._sharded_compressed import ShardedState as ShardedState
from jaxlp.parallel._sharded_compressed import (
  compressed_reduce_scatter as compressed_reduce_scatter,
)
from jaxlp.parallel._sharded_compressed import init_sharded_state as init_sharded_state
from jaxlp.parallel._sharded_compressed import sharded_support as sharded_support
from jaxlp.parallel._sharded_compressed import sharded_wire_bytes as sharded_wire_bytes
from jaxlp.parallel._two_level import psum_two_level as psum_two_level

__all__ = [
    "HIPRESS_COSTS", "ORDERS", "REDUCE_SCATTER_ORDERS", "CompressionState", "LinearCost",
    "PlanEntry", "ReduceGradientsState", "SeCoPaCosts", "ShardedOptState", "ShardedOptimizer",
    "ShardedState", "all_gather",
    "compressed_allreduce", "compressed_optimizer", "compressed_reduce_scatter",
    "compressed_wire_bytes",
    "compressors", "emulate",
    "format_emax", "hipress_costs", "init_compression_state", "init_sharded_state",
    "initialize", "measure_costs", "ordered_psum", "payload_bytes", "psum", "psum_two_level",
    "reduce_gradients", "reduce_scatter", "secopa_plan", "sharded_optimizer", "sharded_support",
    "sharded_wire_bytes", "shutdown", "wire_payload_bytes",
]


def __getattr__(name):
  # Deprecated names: kept working, with a warning that says where they moved.
  if name == "lars":
    import warnings  # noqa: PLC0415

    warnings.warn("jaxlp.parallel.lars moved to jaxlp.optim.lars (an optax transformation); "
                  "the old name will be removed", DeprecationWarning, stacklevel=2)
    from jaxlp.optim import lars  # noqa: PLC0415
    return lars
  raise AttributeError(f"module 'jaxlp.parallel' has no attribute {name!r}")
