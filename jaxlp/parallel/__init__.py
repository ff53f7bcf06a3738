"""jaxlp.parallel: low-precision, order-faithful gradient reduction, APS, node emulation.

Everything runs inside ``jax.pmap``, ``jax.shard_map`` and ``jax.vmap(axis_name=...)``.
"""

from jaxlp.parallel.aps import format_emax as format_emax
from jaxlp.parallel.distributed import initialize as initialize
from jaxlp.parallel.distributed import shutdown as shutdown
from jaxlp.parallel.emulate import emulate as emulate
from jaxlp.parallel.lars import lars as lars
from jaxlp.parallel.psum import ORDERS as ORDERS
from jaxlp.parallel.psum import payload_bytes as payload_bytes
from jaxlp.parallel.psum import psum as psum
from jaxlp.parallel.reduce import ReduceGradientsState as ReduceGradientsState
from jaxlp.parallel.reduce import reduce_gradients as reduce_gradients
from jaxlp.parallel.two_level import psum_two_level as psum_two_level

__all__ = [
    "ORDERS", "ReduceGradientsState", "emulate", "format_emax", "initialize", "lars",
    "payload_bytes", "psum", "psum_two_level", "reduce_gradients", "shutdown",
]
