"""``jaxlp train --policy`` names of the FP4/FP8 recipes and of their pieces.

* ``bf16``: :func:`jaxlp.bf16_policy` on every layer.
* ``nvfp4``: NVFP4 on every operand of every GEMM of every layer, nothing else of the recipe
  (1-D blocks of 16, nearest rounding): ``nvfp4_recipe(weight_tiles=False,
  stochastic_gradients=False, rht=False)``. Pieces are added with ``+``, in any order:
  ``+tiles`` (16 x 16 weight tiles), ``+sr`` (stochastic rounding of the gradients), ``+rht``
  (the random Hadamard transform on the weight-gradient GEMM), ``+ends`` (the first and the
  last layer with a matmul in BF16, the paper's selective high precision).
  ``nvfp4-recipe`` is ``nvfp4+tiles+sr+rht+ends``.
* ``mxfp4``: ``mx_policy(E2M1FN)`` (OCP's floor scale rule) on every layer.
* ``mxfp8-rceil``: :func:`jaxlp.mxfp8_recipe` (``"rceil"`` scales); ``mxfp8`` (the existing
  preset) is the same with OCP's ``"floor"`` rule.

Every matmul the model's layers perform gets the policy (language models: attention's q.k and
p.v and the tied logits too, which the NVFP4 paper keeps in BF16).
"""

from __future__ import annotations

from jaxlp.formats import E2M1FN
from jaxlp.ops import DotPolicy, bf16_policy, mx_policy, mxfp8_recipe, nvfp4_recipe

NVFP4_PIECES = ("tiles", "sr", "rht", "ends")
#: the --policy names this module adds (pieces of ``nvfp4`` combine with ``+``)
RECIPE_NAMES = ("bf16", "nvfp4", "nvfp4-recipe", "mxfp4", "mxfp8-rceil")


def recipe_policy(name: str) -> tuple[DotPolicy, bool] | None:
  """``(policy, ends)`` of a recipe ``--policy`` name (``ends``: the first and last layers
  get :func:`jaxlp.bf16_policy`), or None if ``name`` is not one.

  Raises:
    ValueError: ``nvfp4+...`` with an unknown or repeated piece (the message lists them)."""
  if name == "bf16":
    return bf16_policy(), False
  if name == "mxfp4":
    return mx_policy(E2M1FN), False
  if name == "mxfp8-rceil":
    return mxfp8_recipe("rceil"), False
  if name == "nvfp4-recipe":
    name = "nvfp4+" + "+".join(NVFP4_PIECES)
  if name != "nvfp4" and not name.startswith("nvfp4+"):
    return None
  pieces = name.split("+")[1:]
  bad = [p for p in pieces if p not in NVFP4_PIECES]
  if bad or len(set(pieces)) != len(pieces):
    raise ValueError(f"--policy {name}: pieces of nvfp4 are +{', +'.join(NVFP4_PIECES)}, each "
                     f"at most once; got {'+'.join(pieces)}")
  return nvfp4_recipe(weight_tiles="tiles" in pieces, stochastic_gradients="sr" in pieces,
                      rht="rht" in pieces), "ends" in pieces


def ends_rules(qmodel, *args, **kwargs) -> list:
  """``quantize_model`` rules giving the first and the last layer with a matmul (in call
  order of ``qmodel.init(*args, **kwargs)``) :func:`jaxlp.bf16_policy`."""
  paths = qmodel.quantized_paths(*args, **kwargs)
  ends = dict.fromkeys((paths[0], paths[-1])) if paths else {}
  return [(p, bf16_policy()) for p in ends]
