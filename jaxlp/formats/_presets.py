"""Named formats. Each with an ml_dtypes twin equals that type's cast bit for bit."""

from __future__ import annotations

from jaxlp.formats._float_format import FloatFormat

FP32 = FloatFormat(8, 23, name="FP32")
TF32 = FloatFormat(8, 10, name="TF32")
BF16 = FloatFormat(8, 7, name="BF16")
FP16 = FloatFormat(5, 10, name="FP16")
E5M2 = FloatFormat(5, 2, name="E5M2")  # ml_dtypes.float8_e5m2 (IEEE-like)
E4M3 = FloatFormat(4, 3, name="E4M3")  # ml_dtypes.float8_e4m3 (IEEE-like, max 240)
E4M3FN = FloatFormat(4, 3, specials="fn", name="E4M3FN")  # max 448, overflow -> NaN
E4M3FNUZ = FloatFormat(4, 3, bias=8, specials="fnuz", name="E4M3FNUZ")
E5M2FNUZ = FloatFormat(5, 2, bias=16, specials="fnuz", name="E5M2FNUZ")
E3M4 = FloatFormat(3, 4, name="E3M4")
E3M2FN = FloatFormat(3, 2, specials="finite", name="E3M2FN")  # MX FP6
E2M3FN = FloatFormat(2, 3, specials="finite", name="E2M3FN")  # MX FP6
E2M1FN = FloatFormat(2, 1, specials="finite", name="E2M1FN")  # MX FP4

PRESETS = {f.name: f for f in (FP32, TF32, BF16, FP16, E5M2, E4M3, E4M3FN, E4M3FNUZ, E5M2FNUZ,
                               E3M4, E3M2FN, E2M3FN, E2M1FN)}

# ml_dtypes type name of each preset that has one (TF32 has none).
ML_DTYPES_NAMES = {
    "BF16": "bfloat16", "FP16": "float16", "E5M2": "float8_e5m2", "E4M3": "float8_e4m3",
    "E4M3FN": "float8_e4m3fn", "E4M3FNUZ": "float8_e4m3fnuz", "E5M2FNUZ": "float8_e5m2fnuz",
    "E3M4": "float8_e3m4", "E3M2FN": "float6_e3m2fn", "E2M3FN": "float6_e2m3fn",
    "E2M1FN": "float4_e2m1fn", "FP32": "float32",
}


def get_format(name: str) -> FloatFormat:
  """Look up a preset by name (case-insensitive), e.g. ``get_format("e4m3")``.

  Args:
    name: a key of ``PRESETS`` (``"BF16"``, ``"FP16"``, ``"E4M3FN"``, ...), any case.

  Returns:
    The preset :class:`FloatFormat`.

  Raises:
    ValueError: ``name`` is not a preset (the message lists the presets).

  Example:
    >>> from jaxlp import formats as F
    >>> F.get_format("e4m3fn")
    jaxlp.formats.E4M3FN
    >>> F.get_format("e4m3fn").max_normal, F.get_format("E4M3").max_normal
    (448.0, 240.0)
  """
  key = name.upper()
  if key not in PRESETS:
    raise ValueError(f"unknown format name {name!r}; presets are {sorted(PRESETS)}")
  return PRESETS[key]
