"""jaxlp.parallel: low-precision, order-faithful gradient reduction, APS, node emulation."""

from jaxlp.parallel.psum import ORDERS as ORDERS
from jaxlp.parallel.psum import payload_bytes as payload_bytes
from jaxlp.parallel.psum import psum as psum

__all__ = ["ORDERS", "payload_bytes", "psum"]
