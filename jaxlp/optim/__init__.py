"""jaxlp.optim: optax transformations for low-precision training.

* :func:`master_weights` — HBFP's wide/narrow weight storage as a wrapper transformation.
* :func:`quantize_updates` — round the updates to a format.
* :func:`scale_by_adam`, :func:`trace` — Adam / momentum with moments stored in a format
  (stochastic rounding; the key lives in the state and is split every step).
* :func:`lars` — CPD's LARS variant (moved here from ``jaxlp.parallel``, where the old name
  still works with a ``DeprecationWarning``).

Each returns an ``optax.GradientTransformation`` and composes with optax (``optax.chain``,
``optax.lars``, schedules, ...).
"""

from jaxlp.optim._lars import LarsState as LarsState
from jaxlp.optim._lars import lars as lars
from jaxlp.optim._transforms import LowPrecisionAdamState as LowPrecisionAdamState
from jaxlp.optim._transforms import LowPrecisionTraceState as LowPrecisionTraceState
from jaxlp.optim._transforms import MasterWeightsState as MasterWeightsState
from jaxlp.optim._transforms import QuantizeUpdatesState as QuantizeUpdatesState
from jaxlp.optim._transforms import master_weights as master_weights
from jaxlp.optim._transforms import quantize_updates as quantize_updates
from jaxlp.optim._transforms import scale_by_adam as scale_by_adam
from jaxlp.optim._transforms import trace as trace

__all__ = [
    "LarsState", "LowPrecisionAdamState", "LowPrecisionTraceState", "MasterWeightsState",
    "QuantizeUpdatesState", "lars", "master_weights", "quantize_updates", "scale_by_adam", "trace",
]
