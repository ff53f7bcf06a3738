"""jaxlp: low-precision training research in JAX.

Exact number formats (``jaxlp.formats``), Pallas kernels (``jaxlp.pallas``), quantized
layers (``jaxlp.ops``), data-parallel low-precision / compressed reduction
(``jaxlp.parallel``). Integrations with optional dependencies load on first use:
``jaxlp.flax`` (Flax), ``jaxlp.optim`` (optax), ``jaxlp.torch`` (PyTorch),
``jaxlp.training`` (the training loop of the ``jaxlp`` command, as a library).
"""

import importlib as _importlib

__version__ = "0.1.0"

# Every name is loaded on first access (PEP 562), so ``import jaxlp`` does not import JAX: the
# ``jaxlp`` command installs its Ctrl-C handling before anything heavy loads. Subpackages with
# optional dependencies (flax, optax, torch) load only when used.
_SUBPACKAGES = ("formats", "ops", "pallas", "parallel")
_LAZY = ("flax", "optim", "torch", "training", "cli")
_NAMES = {
    "BlockFormat": "formats", "FixedPoint": "formats", "FloatFormat": "formats",
    "Accum": "ops", "DotPolicy": "ops", "Quant": "ops", "conv_general_dilated": "ops",
    "dot_general": "ops", "float_policy": "ops", "hbfp_policy": "ops", "matmul": "ops",
    "mx_policy": "ops", "quantize": "ops", "RHT": "ops", "bf16_policy": "ops",
    "mxfp8_recipe": "ops", "nvfp4_recipe": "ops",
}


def __getattr__(name):
  if name in _SUBPACKAGES or name in _LAZY:
    return _importlib.import_module(f"jaxlp.{name}")
  if name in _NAMES:
    value = getattr(_importlib.import_module(f"jaxlp.{_NAMES[name]}"), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'jaxlp' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__) | set(_LAZY))


__all__ = [
    "Accum",
    "BlockFormat",
    "DotPolicy",
    "FixedPoint",
    "FloatFormat",
    "Quant",
    "RHT",
    "bf16_policy",
    "conv_general_dilated",
    "dot_general",
    "float_policy",
    "formats",
    "hbfp_policy",
    "matmul",
    "mx_policy",
    "mxfp8_recipe",
    "nvfp4_recipe",
    "ops",
    "pallas",
    "parallel",
    "quantize",
]
