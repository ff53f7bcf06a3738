"""One validation per concept: every entry point that rounds to a format (the spec, the
dispatching ``jaxlp.quantize``, the Pallas kernel, the layer policies, the optax transforms
and the torch bridge) rejects the same bad (format, rounding, key) with the same error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxlp
from jaxlp import formats as F

X = jnp.linspace(-2.0, 2.0, 16, dtype=jnp.float32)
KEY = jax.random.key(0)

# (id, fmt, rounding, needs a key?, the error every entry point must raise)
BAD = [
    ("unknown rounding", F.E4M3, "nearst", False, (ValueError, "nearst")),
    ("not a format", "E4M3", "nearest", False, (TypeError, "format")),
    ("not a format (int)", 3, "nearest", False, (TypeError, "format")),
    ("rounding the format lacks", F.cpd_float(5, 2), "stochastic", True,
     (ValueError, "stochastic")),
]


def _entry_points():
  eps = {
      "formats.quantize": lambda fmt, r, key: F.quantize(X, fmt, r, key=key),
      "jaxlp.quantize": lambda fmt, r, key: jaxlp.quantize(X, fmt, r, key=key),
      "pallas.quantize": lambda fmt, r, key: jaxlp.pallas.quantize(X, fmt, r, key=key,
                                                                   interpret=True),
      "Quant (layer policy)": lambda fmt, r, key: jaxlp.Quant(fmt, r),
  }
  try:
    import jaxlp.optim as O
  except ImportError:
    pass
  else:
    eps["optim.quantize_updates"] = lambda fmt, r, key: O.quantize_updates(fmt, r, key=key)
    eps["optim.trace"] = lambda fmt, r, key: O.trace(0.9, fmt=fmt, rounding=r, key=key)
  try:
    import torch

    import jaxlp.torch as JT
  except ImportError:
    pass
  else:
    eps["torch.quantize"] = lambda fmt, r, key: JT.quantize(torch.linspace(-2, 2, 16), fmt, r,
                                                            seed=0)
  return eps


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_every_entry_point_gives_the_same_error(case):
  _, fmt, rounding, needs_key, (exc, text) = case
  key = KEY if needs_key or rounding == "stochastic" else None
  messages = {}
  for name, call in _entry_points().items():
    with pytest.raises(exc) as info:
      call(fmt, rounding, key)
    assert text in str(info.value), (name, str(info.value))
    # the same sentence after the entry point's own name; the torch bridge's list of
    # accepted formats also names its torch-only QPyTorchFixedPoint
    messages[name] = str(info.value).split(":", 1)[-1].split(" (")[0].strip()
  assert len(set(messages.values())) == 1, messages


def test_stochastic_without_a_key_is_refused_everywhere():
  for name, call in _entry_points().items():
    if name.startswith("torch") or name.startswith("Quant"):
      continue  # the bridge draws its key from torch's RNG; a policy takes keys per call
    with pytest.raises(ValueError, match="key"):
      call(F.E4M3, "stochastic", None)
