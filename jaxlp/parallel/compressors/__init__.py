"""Gradient compressors with explicit state, bit-packed payloads and exact wire sizes.

Each compressor has one public name, its factory (``cgx(bits=4)``), which returns a frozen
config object with ``init / encode / decode / wire_bytes`` and its family's ``aggregation``
(the typed interfaces :class:`Compressor` and :class:`Aggregation`). Aggregate with
:func:`jaxlp.parallel.compressed_allreduce`; count bytes with
:func:`jaxlp.parallel.compressed_wire_bytes`.
"""

from jaxlp.parallel.compressors._base import pack_bits as pack_bits
from jaxlp.parallel.compressors._base import payload_nbytes as payload_nbytes
from jaxlp.parallel.compressors._base import unpack_bits as unpack_bits
from jaxlp.parallel.compressors._cast import cast as cast
from jaxlp.parallel.compressors._lowrank import orthogonalize as orthogonalize
from jaxlp.parallel.compressors._powersgd import powersgd as powersgd
from jaxlp.parallel.compressors._protocol import Aggregation as Aggregation
from jaxlp.parallel.compressors._protocol import Bucket as Bucket
from jaxlp.parallel.compressors._protocol import Compressor as Compressor
from jaxlp.parallel.compressors._protocol import ReduceContext as ReduceContext
from jaxlp.parallel.compressors._quantizers import cgx as cgx
from jaxlp.parallel.compressors._quantizers import onebit as onebit
from jaxlp.parallel.compressors._quantizers import qsgd as qsgd
from jaxlp.parallel.compressors._quantizers import tbq as tbq
from jaxlp.parallel.compressors._quantizers import terngrad as terngrad
from jaxlp.parallel.compressors._sparse import dgc as dgc
from jaxlp.parallel.compressors._sparse import graddrop as graddrop
from jaxlp.parallel.compressors._sparse import randomk as randomk
from jaxlp.parallel.compressors._sparse import topk as topk

__all__ = [
    "Aggregation", "Bucket", "Compressor", "ReduceContext", "cast", "cgx", "dgc", "graddrop",
    "onebit", "orthogonalize",
    "pack_bits", "payload_nbytes", "powersgd", "qsgd", "randomk", "tbq", "terngrad", "topk",
    "unpack_bits",
]

# The compressor classes were exported next to their factories; one name per compressor now.
_CLASSES = {
    "Cast": "jaxlp.parallel.compressors._cast",
    "PowerSGD": "jaxlp.parallel.compressors._powersgd",
    "CGX": "jaxlp.parallel.compressors._quantizers",
    "QSGD": "jaxlp.parallel.compressors._quantizers",
    "TBQ": "jaxlp.parallel.compressors._quantizers",
    "OneBit": "jaxlp.parallel.compressors._quantizers",
    "TernGrad": "jaxlp.parallel.compressors._quantizers",
    "DGC": "jaxlp.parallel.compressors._sparse",
    "GradDrop": "jaxlp.parallel.compressors._sparse",
    "RandomK": "jaxlp.parallel.compressors._sparse",
    "TopK": "jaxlp.parallel.compressors._sparse",
}


def __getattr__(name):
  if name in _CLASSES:
    import importlib  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    warnings.warn(f"jaxlp.parallel.compressors.{name} is deprecated: call the factory "
                  f"jaxlp.parallel.compressors.{name.lower()}(...) (type(...) gives the class)",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_CLASSES[name]), name)
  raise AttributeError(f"module 'jaxlp.parallel.compressors' has no attribute {name!r}")
