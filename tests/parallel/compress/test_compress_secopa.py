"""SeCoPa reproduces HiPress's published plan (mark14wu/hipress src/SeCoPa, VGG19, PS, N=4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.parallel.compressors as C
from jaxlp.parallel._secopa import LinearCost, measure_costs, secopa_plan

# HiPress's input.txt (VGG19 gradient names and fp32 element counts)
VGG19 = [("conv0_weight", 1728), ("conv0_bias", 64), ("conv1_weight", 36864), ("conv1_bias", 64),
         ("conv2_weight", 73728), ("conv2_bias", 128), ("conv3_weight", 147456),
         ("conv3_bias", 128), ("conv4_weight", 294912), ("conv4_bias", 256),
         ("conv5_weight", 589824), ("conv5_bias", 256), ("conv6_weight", 589824),
         ("conv6_bias", 256), ("conv7_weight", 589824), ("conv7_bias", 256),
         ("conv8_weight", 1179648), ("conv8_bias", 512)] + [
             (f"conv{i}_{k}", 2359296 if k == "weight" else 512)
             for i in range(9, 16) for k in ("weight", "bias")] + [
                 ("dense0_weight", 102760448), ("dense0_bias", 4096),
                 ("dense1_weight", 16777216), ("dense1_bias", 4096),
                 ("dense2_weight", 4096000)]
# HiPress's shipped SeCoPaPlan.txt rows for the above (topology PS, 4 nodes)
PUBLISHED = ["n,4"] * 16 + ["y,2", "n,4"] + ["y,4", "n,4"] * 7 + ["y,4", "n,4", "y,4", "n,4",
                                                                   "y,4"]


def test_reproduces_published_vgg19_plan():
  plan = secopa_plan([s for _, s in VGG19], topology="ps", num_nodes=4)
  got = [f"{'y' if e.compress else 'n'},{e.partitions}" for e in plan]
  assert got == PUBLISHED
  # the published file's last row was generated for size 1048576: "y,1"
  (last,) = secopa_plan([1048576], topology="PS", num_nodes=4)
  assert (last.compress, last.partitions) == (True, 1)


@pytest.mark.parametrize("size,ps,ring", [
    (1179648, [(True, 2), (False, 8), (False, 16)], [(True, 4), (True, 8), (False, 16)]),
    (2359296, [(True, 4), (True, 3), (False, 16)], [(True, 4), (True, 8), (True, 16)]),
    (102760448, [(True, 4), (True, 8), (True, 16)], [(True, 4), (True, 8), (True, 16)]),
    (262144, [(False, 4), (False, 8), (False, 16)], [(False, 4), (False, 8), (False, 16)])])
def test_spec_examples(size, ps, ring):
  for topo, want in (("ps", ps), ("ring", ring)):
    got = [tuple(secopa_plan([size], topology=topo, num_nodes=n)[0][:2]) for n in (4, 8, 16)]
    assert got == want


def test_cost_primitive_and_errors():
  c = LinearCost(2.0, 1.0, 5.0)
  assert c.threshold == 2.0 and c(1.0) == 5.0 and c(3.0) == 7.0
  assert LinearCost(0.0, 0.0, 0.0)(10) == 0.0
  with pytest.raises(ValueError, match="num_nodes"):
    secopa_plan([10], topology="ps", num_nodes=5)
  with pytest.raises(ValueError, match="topology"):
    secopa_plan([10], topology="tree", num_nodes=4)


def test_measure_costs_drives_plan():
  costs = measure_costs(C.cgx(4, 512), sizes=(2 ** 10, 2 ** 13, 2 ** 16), repeats=2,
                        bandwidth_gbps=1.0)
  assert costs.encode.weight >= 0 and 0 < costs.ratio < 0.2
  plan = secopa_plan({"a": jnp.zeros((4096, 4096)), "b": jnp.zeros((8,))}, topology="ring",
                     num_nodes=4, costs=costs)
  assert len(plan) == 2 and not plan[1].compress


@pytest.mark.parametrize("sizes,kw,exc,match", [
    ([-5, 100], {}, ValueError, r"sizes\[0\]=-5 is negative"),
    ([100, 2.5], {}, TypeError, r"sizes\[1\]=2.5 is a float"),
    ([float("nan")], {}, TypeError, r"sizes\[0\]=nan is a float"),
    ([np.float32(4.0)], {}, TypeError, r"sizes\[0\]=.*is a float32"),
    ([True, 4], {}, TypeError, r"sizes\[0\]=True is a bool"),
    ([5, None], {}, TypeError, r"sizes\[1\]=None is neither"),
    ({"w": -1}, {}, ValueError, r"sizes\['w'\]=-1 is negative"),
    ({"w": "x"}, {}, TypeError, r"sizes\['w'\]='x' is neither"),
    (None, {}, TypeError, "sizes must be"),
    ("abc", {}, TypeError, "sizes must be"),
    ([10], dict(num_nodes=2.5), TypeError, "num_nodes must be an int, got 2.5"),
    ([10], dict(num_nodes=True), TypeError, "num_nodes must be an int, got True"),
    ([10], dict(num_nodes=0), ValueError, "num_nodes must be >= 1"),
    ([10], dict(topology=3), TypeError, "topology must be"),
    ([10], dict(costs=3), TypeError, "costs must be a SeCoPaCosts"),
], ids=repr)
def test_bad_arguments_are_refused_by_name(sizes, kw, exc, match):
  """Issue 49: ``secopa_plan([-5, 100], num_nodes=4)`` returned a plan for -5 elements."""
  kw = {"num_nodes": 4, **kw}
  with pytest.raises(exc, match=match):
    secopa_plan(sizes, **kw)


def test_counts_of_every_accepted_kind():
  plan = secopa_plan([0, np.int32(2 ** 22), 1000], num_nodes=4)
  assert plan[1:] == secopa_plan([2 ** 22, 1000], num_nodes=4) and len(plan) == 3
  tree = {"b": jnp.zeros(1000), "w": jax.ShapeDtypeStruct((2048, 2048), jnp.float32), "n": 7}
  assert secopa_plan(tree, num_nodes=16) == secopa_plan([1000, 7, 2048 * 2048], num_nodes=16)
