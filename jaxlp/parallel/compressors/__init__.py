"""Gradient compressors with explicit state, bit-packed payloads and exact wire sizes.

Each factory returns a frozen config object with ``init / encode / decode / wire_bytes``
(see :mod:`jaxlp.parallel.compressors._base`). Aggregate with
:func:`jaxlp.parallel.compressed.compressed_allreduce`.
"""

from jaxlp.parallel.compressors._base import pack_bits as pack_bits
from jaxlp.parallel.compressors._base import payload_nbytes as payload_nbytes
from jaxlp.parallel.compressors._base import unpack_bits as unpack_bits
from jaxlp.parallel.compressors.cast import Cast as Cast
from jaxlp.parallel.compressors.cast import cast as cast
from jaxlp.parallel.compressors.powersgd import PowerSGD as PowerSGD
from jaxlp.parallel.compressors.powersgd import orthogonalize as orthogonalize
from jaxlp.parallel.compressors.powersgd import powersgd as powersgd
from jaxlp.parallel.compressors.quantizers import CGX as CGX
from jaxlp.parallel.compressors.quantizers import QSGD as QSGD
from jaxlp.parallel.compressors.quantizers import TBQ as TBQ
from jaxlp.parallel.compressors.quantizers import OneBit as OneBit
from jaxlp.parallel.compressors.quantizers import TernGrad as TernGrad
from jaxlp.parallel.compressors.quantizers import cgx as cgx
from jaxlp.parallel.compressors.quantizers import onebit as onebit
from jaxlp.parallel.compressors.quantizers import qsgd as qsgd
from jaxlp.parallel.compressors.quantizers import tbq as tbq
from jaxlp.parallel.compressors.quantizers import terngrad as terngrad
from jaxlp.parallel.compressors.sparse import DGC as DGC
from jaxlp.parallel.compressors.sparse import GradDrop as GradDrop
from jaxlp.parallel.compressors.sparse import RandomK as RandomK
from jaxlp.parallel.compressors.sparse import TopK as TopK
from jaxlp.parallel.compressors.sparse import dgc as dgc
from jaxlp.parallel.compressors.sparse import graddrop as graddrop
from jaxlp.parallel.compressors.sparse import randomk as randomk
from jaxlp.parallel.compressors.sparse import topk as topk

__all__ = [
    "CGX", "QSGD", "TBQ", "Cast", "DGC", "GradDrop", "OneBit", "PowerSGD", "RandomK",
    "TernGrad", "TopK", "cast", "cgx", "dgc", "graddrop", "onebit", "orthogonalize",
    "pack_bits", "payload_nbytes", "powersgd", "qsgd", "randomk", "tbq", "terngrad", "topk",
    "unpack_bits",
]
