"""jaxlp.parallel: low-precision, order-faithful gradient reduction, APS, node emulation.

Everything runs inside ``jax.pmap``, ``jax.shard_map`` and ``jax.vmap(axis_name=...)``.
"""

from jaxlp.parallel import compressors as compressors
from jaxlp.parallel.aps import format_emax as format_emax
from jaxlp.parallel.compressed import CompressionState as CompressionState
from jaxlp.parallel.compressed import compressed_allreduce as compressed_allreduce
from jaxlp.parallel.compressed import init_compression_state as init_compression_state
from jaxlp.parallel.compressed import ordered_psum as ordered_psum
from jaxlp.parallel.distributed import initialize as initialize
from jaxlp.parallel.distributed import shutdown as shutdown
from jaxlp.parallel.emulate import emulate as emulate
from jaxlp.parallel.lars import lars as lars
from jaxlp.parallel.psum import ORDERS as ORDERS
from jaxlp.parallel.psum import payload_bytes as payload_bytes
from jaxlp.parallel.psum import psum as psum
from jaxlp.parallel.reduce import ReduceGradientsState as ReduceGradientsState
from jaxlp.parallel.reduce import reduce_gradients as reduce_gradients
from jaxlp.parallel.secopa import HIPRESS_COSTS as HIPRESS_COSTS
from jaxlp.parallel.secopa import LinearCost as LinearCost
from jaxlp.parallel.secopa import PlanEntry as PlanEntry
from jaxlp.parallel.secopa import SeCoPaCosts as SeCoPaCosts
from jaxlp.parallel.secopa import hipress_costs as hipress_costs
from jaxlp.parallel.secopa import measure_costs as measure_costs
from jaxlp.parallel.secopa import secopa_plan as secopa_plan
from jaxlp.parallel.two_level import psum_two_level as psum_two_level

__all__ = [
    "HIPRESS_COSTS", "ORDERS", "CompressionState", "LinearCost", "PlanEntry",
    "ReduceGradientsState", "SeCoPaCosts", "compressed_allreduce", "compressors", "emulate",
    "format_emax", "hipress_costs", "init_compression_state", "initialize", "lars",
    "measure_costs", "ordered_psum", "payload_bytes", "psum", "psum_two_level",
    "reduce_gradients", "secopa_plan", "shutdown",
]
