"""quantize_model covers every matmul of Flax's own sequence models (linen and nnx).

Each test traces a training step (loss + grad) with ``jax.make_jaxpr``, counts the
``dot_general`` / ``conv_general_dilated`` equations itself (recursively, through pjit,
custom_vjp, scan and remat sub-jaxprs) and checks the report against that count and the
policies asked for.

The tests marked ``FAST`` check what holds at any XLA optimization level (traced jaxprs,
reports, errors, shapes, stochastic runs compared with each other in the same test): they
compile with XLA's optimizations off (``fast_compile``, tests/conftest.py). The tests that
claim a quantized or rewired module's bits (== Flax's, == the quantizer applied by hand) compile
normally.
"""

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
import jaxlp.flax as jf
from jaxlp import formats as F
from jaxlp.flax import _report as R
from jaxlp.flax._attention import dot_product_attention
from jaxlp.ops._policy import DotPolicy, float_policy, hbfp_policy, mx_policy

FAST = pytest.mark.usefixtures("fast_compile")
HBFP = hbfp_policy(7, 4)
BF16 = float_policy(F.BF16)
E4M3 = float_policy(F.E4M3)
VOCAB, EMB, HEADS, SEQ, BATCH = 11, 8, 2, 6, 2
TOKENS = jnp.arange(BATCH * SEQ).reshape(BATCH, SEQ) % VOCAB


def matmul_eqns(jaxpr):
  """(primitive, name stack) of every dot_general / conv in ``jaxpr``, written independently of
  jaxlp's census: sub-jaxprs found in any parameter, name stacks as strings, prefixed."""
  out = []

  def walk(jp, prefix):
    for eqn in jp.eqns:
      stack = prefix + [str(s.name) for s in eqn.source_info.name_stack.stack]
      if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
        out.append((eqn.primitive.name, stack))
      for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          if isinstance(sub, jex.core.ClosedJaxpr):
            walk(sub.jaxpr, stack)
          elif isinstance(sub, jex.core.Jaxpr):
            walk(sub, stack)

  walk(jaxpr.jaxpr, [])
  return out


def loss_fn(logits):
  return jnp.mean(jax.nn.log_softmax(logits)[..., 0])


# ------------------------------------------------------------------------- the models


class Block(nn.Module):
  """Pre-LN transformer block (lm1b-style): x + attn(LN(x)), x + mlp(LN(x))."""

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    y = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=EMB, deterministic=True,
                                        name="attn")(nn.LayerNorm()(x), mask=mask)
    x = x + y
    y = nn.Dense(2 * EMB)(nn.LayerNorm()(x))
    return x + nn.Dense(EMB)(nn.gelu(y))


class LinenLM(nn.Module):
  """A small decoder LM with tied input/output embeddings (``Embed.attend``)."""

  remat: bool = False
  layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, EMB)
    x = embed(tokens)
    block = nn.remat(Block) if self.remat else Block
    for _ in range(self.layers):
      x = block()(x)
    return embed.attend(nn.LayerNorm()(x))


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(EMB, rngs=rngs), nnx.LayerNorm(EMB, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, EMB, decode=False, rngs=rngs)
    self.fc1, self.fc2 = nnx.Linear(EMB, 2 * EMB, rngs=rngs), nnx.Linear(2 * EMB, EMB, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class NnxLM(nnx.Module):
  def __init__(self, rngs, layers=2):
    self.embed = nnx.Embed(VOCAB, EMB, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(rngs) for _ in range(layers)])
    self.ln = nnx.LayerNorm(EMB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for b in self.blocks:
      x = b(x)
    return self.embed.attend(self.ln(x))


@functools.cache
def lm_variables(abstract: bool = True, remat: bool = False):
  """LinenLM's variables: ShapeDtypeStructs for the trace-only tests, else one jitted init."""
  init = functools.partial(LinenLM(remat=remat).init, jax.random.key(0), TOKENS)
  return jax.eval_shape(init) if abstract else jax.jit(init)()


KIND_POLICY = {"dense": HBFP, "attention_qk": BF16, "attention_pv": BF16, "embed_attend": E4M3}
# per layer: q, k, v, out, fc1, fc2 (fwd, dlhs, drhs) + q.k and p.v (fwd, dlhs, drhs); tied
# logits (fwd, dlhs, drhs)
LM_MATMULS = 2 * (6 * 3 + 2 * 3) + 3


def _linen_step(qm, variables):
  return jax.make_jaxpr(lambda p: jax.grad(lambda p: loss_fn(qm.apply(
      {"params": p}, TOKENS)))(p))(variables["params"])


def test_linen_transformer_quantized_paths_and_identity_bits():
  model = LinenLM()
  q = jf.quantize_model(model, KIND_POLICY)
  paths = q.quantized_paths(jax.random.key(0), TOKENS)
  assert "Block_0/attn" in paths and "Embed_0" in paths
  assert "Block_0/attn/query" in paths and len(paths) == len(set(paths)) == 15
  # DotPolicy() everywhere: every rewired matmul (attention hooks, attend) gives Flax's bits
  ident = jf.quantize_model(model, DotPolicy())
  v = lm_variables(abstract=False)
  want, got, quantized = jax.jit(lambda v: tuple(m.apply(v, TOKENS) for m in (model, ident, q)))(v)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(quantized, want)


class RawEinsum(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4)(x)
    return jnp.einsum("bd,be->de", x, x)  # a raw matmul jaxlp cannot wrap


class Outer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return RawEinsum(name="gram")(x).sum() + nn.Dense(2)(x).sum()


def _quantized_along_last(x, policy):
  return jaxlp.quantize(x, policy.lhs.fmt, policy.lhs.rounding)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")
@pytest.mark.parametrize("policy", [E4M3, mx_policy(F.E4M3FN, block_size=4)],
                         ids=["e4m3", "mxfp8-b4"])
def test_attention_logits_equal_einsum_of_quantized_q_and_k(policy):
  """q.k under a policy == jnp.einsum of the quantized q and k (an elementwise format, and MX
  blocks of 4 along the head dim (8): the contraction), through the whole attention module."""
  x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, EMB))
  ref_qk = lambda s, a, b: jnp.einsum(s, _quantized_along_last(a, policy),
                                      _quantized_along_last(b, policy))
  plain_pv = lambda s, a, b: jnp.einsum(s, a, b)
  # linen: the same module with Flax's own hooks set to the reference
  attn = nn.SelfAttention(num_heads=HEADS, qkv_features=2 * EMB)
  v = attn.init(jax.random.key(1), x)
  ref = nn.SelfAttention(num_heads=HEADS, qkv_features=2 * EMB,
                         qk_attn_weights_einsum_cls=lambda: ref_qk,
                         attn_weights_value_einsum_cls=lambda: plain_pv)
  q = jf.quantize_model(attn, {"attention_qk": policy})
  got, want = jax.jit(q.apply)(v, x), jax.jit(ref.apply)(v, x)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got, attn.apply(v, x))
  # nnx: jaxlp's attention function against linen's dot_product_attention with the reference
  mha = nnx.MultiHeadAttention(HEADS, EMB, qkv_features=2 * EMB, decode=False,
                               rngs=nnx.Rngs(0))
  qm = jf.quantize_model(mha, {"attention_qk": policy})

  @nnx.jit
  def nnx_ref(m, x):
    o = nn.dot_product_attention(m.query(x), m.key(x), m.value(x), qk_attn_weights_einsum=ref_qk,
                                 attn_weights_value_einsum=plain_pv)
    return m.out(o)

  np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(qm, x), nnx_ref(mha, x))


@pytest.mark.parametrize("cell", ["LSTMCell", "OptimizedLSTMCell", "GRUCell"])
def test_linen_recurrent_cells_through_rnn(cell):
  x = jax.random.normal(jax.random.key(0), (2, 5, 3))
  model = nn.RNN(getattr(nn, cell)(4))
  v = model.init(jax.random.key(1), x)
  q = jf.quantize_model(model, {"recurrent": BF16})
  assert jax.tree.all(jax.tree.map(np.array_equal, q.init(jax.random.key(1), x), v))
  n = len(matmul_eqns(jax.make_jaxpr(lambda v: jax.grad(
      lambda p: jnp.sum(q.apply({"params": p}, x)))(v["params"]))(v)))
  report = q.matmul_report(v, x, loss_fn=jnp.sum)
  gates = {"LSTMCell": 8, "OptimizedLSTMCell": 2, "GRUCell": 6}[cell]
  assert len(report) == n == 3 * gates  # inside the scan: fwd, dlhs, drhs of each gate matmul
  assert report.count(kind="recurrent", status="quantized", policy=BF16) == n
  assert report.count(direction="dlhs") == report.count(direction="drhs") == gates
  # DotPolicy(): the rewired cell (OptimizedLSTMCell re-implemented) gives Flax's bits
  ident = jf.quantize_model(model, DotPolicy())
  want, got, quantized = jax.jit(lambda v: tuple(m.apply(v, x) for m in (model, ident, q)))(v)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(quantized, want)


def test_einsum_linear_general_and_embed_attend_linen_and_nnx():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8))
  pol = mx_policy(F.E4M3FN, block_size=4)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.Einsum((8, 2, 4), "btd,dhk->bthk")(x)
      y = nn.DenseGeneral(8, axis=(-2, -1))(y)
      return nn.Embed(5, 8).attend(y)

  v = Net().init(jax.random.key(1), x)
  q = jf.quantize_model(Net(), pol)
  r = q.matmul_report(v, x, loss_fn=jnp.sum)
  assert [(op.kind, op.direction) for op in r if op.direction == "fwd"] == [
      ("einsum", "fwd"), ("dense", "fwd"), ("embed_attend", "fwd")]
  # jaxlp's backward also computes the einsum's dlhs (x is constant; XLA drops it)
  assert len(r) == 9 and r.count(status="quantized") == 9
  # the einsum's forward == jnp.einsum of the operands quantized along the contraction (d)
  e = nn.Einsum((8, 2, 4), "btd,dhk->bthk", use_bias=False)
  ve = e.init(jax.random.key(2), x)
  got = jax.jit(jf.quantize_model(e, pol).apply)(ve, x)
  kq = jaxlp.quantize(ve["params"]["kernel"], dataclasses.replace(pol.rhs.fmt, axis=0))
  want = jax.jit(lambda a, b: jnp.einsum("btd,dhk->bthk", a, b))(
      jaxlp.quantize(x, pol.lhs.fmt), kq)
  np.testing.assert_array_equal(got, want)
  # identity policy: the re-implemented Einsum and attend give Flax's bits
  ident = jf.quantize_model(Net(), DotPolicy())
  want, got = jax.jit(lambda v: (Net().apply(v, x), ident.apply(v, x)))(v)
  np.testing.assert_array_equal(got, want)

  class NnxNet(nnx.Module):
    def __init__(self, rngs):
      self.e = nnx.Einsum("btd,dhk->bthk", (8, 2, 4), (2, 4), rngs=rngs)
      self.g = nnx.LinearGeneral((2, 4), 8, axis=(-2, -1), rngs=rngs)
      self.emb = nnx.Embed(5, 8, rngs=rngs)

    def __call__(self, x):
      return self.emb.attend(self.g(self.e(x)))

  m = NnxNet(nnx.Rngs(0))
  qn = jf.quantize_model(m, pol)
  rn = jf.matmul_report(qn, x, loss_fn=jnp.sum)
  assert [(op.path, op.kind) for op in rn if op.direction == "fwd"] == [
      ("e", "einsum"), ("g", "dense"), ("emb", "embed_attend")]
  assert rn.count(status="quantized") == len(rn) == 9
  assert isinstance(qn.emb, nnx.Embed) and type(m.emb) is nnx.Embed
  ident = jf.quantize_model(m, DotPolicy())
  want, got, quantized = nnx.jit(lambda a, b, c: (a(x), b(x), c(x)))(m, ident, qn)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(quantized, want)


@FAST
@pytest.mark.parametrize("remat", [False, True])
def test_linen_transformer_every_matmul_quantized_as_asked(remat):
  model = LinenLM(remat=remat)
  v = lm_variables(remat=remat)
  plain_count = len(matmul_eqns(_linen_step(model, v)))
  q = jf.quantize_model(model, KIND_POLICY)
  eqns = matmul_eqns(_linen_step(q, v))
  # the same matmuls as the plain model's step, and every one under a jaxlp scope
  assert len(eqns) == plain_count == (LM_MATMULS if not remat else plain_count)
  untagged = [s for _, s in eqns if not any(n.startswith("jaxlp:") for n in s)]
  assert untagged == []
  report = q.matmul_report(v, TOKENS, loss_fn=loss_fn)
  assert len(report) == len(eqns)
  assert report.unquantized_ops() == [] and report.excluded_ops() == []
  for op in report:
    assert op.policy == KIND_POLICY[op.kind], op
  want = {"dense": 12, "attention_qk": 2, "attention_pv": 2, "embed_attend": 1}
  for kind, n in want.items():
    assert report.count(kind=kind, direction="dlhs") == n
    assert report.count(kind=kind, direction="drhs") == n
    fwd = report.count(kind=kind, direction="fwd")
    # remat recomputes (most of) the blocks' forward matmuls inside the backward pass
    assert fwd == n if not remat or kind == "embed_attend" else n < fwd <= 2 * n
  if not remat:
    assert report.count(kind="attention_qk", path="Block_1/attn") == 3
  plain = jf.matmul_report(jf.quantize_model(model, {}), v, TOKENS, loss_fn=loss_fn)
  assert len(plain) == len(eqns) and plain.count(status="excluded") == len(eqns)
  assert len(jf.quantize_model(model, {}).matmul_report(v, TOKENS)) == LM_MATMULS // 3


@FAST
def test_nnx_transformer_every_matmul_quantized_as_asked():
  model = NnxLM(nnx.Rngs(0))
  q = jf.quantize_model(model, KIND_POLICY)
  graphdef, state = nnx.split(q)

  def step(state):
    return nnx.grad(lambda m: loss_fn(m(TOKENS)))(nnx.merge(graphdef, state))

  eqns = matmul_eqns(jax.make_jaxpr(step)(state))
  assert len(eqns) == LM_MATMULS
  assert [s for _, s in eqns if not any(n.startswith("jaxlp:") for n in s)] == []
  report = jf.matmul_report(q, TOKENS, loss_fn=loss_fn)
  assert len(report) == LM_MATMULS and report.count(status="quantized") == LM_MATMULS
  for op in report:
    assert op.policy == KIND_POLICY[op.kind], op
  assert report.count(kind="attention_qk", path="blocks/1/attn") == 3
  assert report.count(kind="embed_attend", direction="drhs") == 1
  assert report.count(kind="dense", path="blocks/0/attn/query") == 3
  # the original model is untouched (copy=True) and its attention matmuls are not jaxlp's
  raw = jf.matmul_report(model, TOKENS, loss_fn=loss_fn)
  assert raw.count(status="unquantized") == len(raw)
  assert {op.path for op in raw} >= {"blocks/0/attn", "embed", "blocks/1/fc2"}
  # Flax's attention kept when both attention kinds are FP32: reported as excluded
  half = jf.quantize_model(model, {"dense": HBFP})
  r = jf.matmul_report(half, TOKENS)
  assert r.count(kind="attention", status="excluded") == 4
  assert r.count(kind="embed_attend", status="excluded") == 1
  assert r.count(status="quantized") == 12 and r.unquantized_ops() == []


@FAST
def test_per_kind_policies_rules_and_precedence():
  model = LinenLM()
  v = lm_variables()
  q = jf.quantize_model(
      model, {"default": HBFP, "attention_qk": BF16, "attention_pv": BF16, "embed_attend": None},
      exclude="Block_0/Dense_1", rules=[("Block_1/*", {"dense": E4M3}),
                                        ("Block_1/attn", None)])
  report = q.matmul_report(v, TOKENS)
  got = {(op.path, op.kind): (op.policy, op.source, op.status) for op in report}
  assert got[("Block_0/Dense_0", "dense")] == (HBFP, "policy['default']", "quantized")
  assert got[("Block_0/Dense_1", "dense")] == (None, "include/exclude", "excluded")
  assert got[("Block_0/attn", "attention_pv")] == (BF16, "policy['attention_pv']", "quantized")
  assert got[("Block_1/Dense_0", "dense")] == (E4M3, "rules[0]['dense']", "quantized")
  assert got[("Block_1/attn/query", "dense")][:2] == (E4M3, "rules[0]['dense']")
  # rule 0 has no attention entry: falls through to rule 1 (None: FP32)
  assert got[("Block_1/attn", "attention_qk")] == (None, "rules[1]", "excluded")
  assert got[("Embed_0", "embed_attend")] == (None, "policy['embed_attend']", "excluded")
  assert len(report) == LM_MATMULS // 3
  # a plain DotPolicy still means every kind; include/exclude as before
  q2 = jf.quantize_model(model, HBFP, include="Block_0/*")
  r2 = q2.matmul_report(v, TOKENS)
  assert r2.count(status="quantized") == 8 and r2.count(status="excluded") == 9
  # Flax refuses precision= together with its attention einsum hooks: jaxlp passes it on
  attn = nn.MultiHeadDotProductAttention(num_heads=2, precision="highest")
  x = jnp.ones((1, 3, 4))
  r3 = jf.quantize_model(attn, BF16).matmul_report(
      jax.eval_shape(attn.init, jax.random.key(0), x), x)
  assert r3.count(status="quantized") == len(r3) == 6
  with pytest.raises(ValueError, match="unknown kind 'attention'"):
    jf.quantize_model(model, {"attention": BF16})
  with pytest.raises(TypeError, match=r"policy\['dense'\]"):
    jf.quantize_model(model, {"dense": "hbfp"})
  with pytest.raises(TypeError, match=r"rules\[0\]"):
    jf.quantize_model(model, HBFP, rules=["Block_0"])
  with pytest.raises(TypeError, match="mapping"):
    jf.quantize_model(model, None)


@FAST
def test_strict_refuses_a_raw_matmul_and_names_it():
  x = jnp.ones((3, 5))
  q = jf.quantize_model(Outer(), HBFP, strict=True)
  with pytest.raises(ValueError, match=r"(?s)1 matmul\(s\).*dot_general fwd in gram: "
                                       r"\(3, 4\) x \(3, 4\) -> \(4, 4\) at .*test_whole_model"):
    q.init(jax.random.key(0), x)
  v = Outer().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="in gram"):
    jax.jit(q.apply)(v, x)
  # excluding the module's path (or a None rule) accepts it, as FP32 by choice
  for kw in ({"exclude": "gram"}, {"rules": [("gram", None)]}):
    ok = jf.quantize_model(Outer(), HBFP, strict=True, **kw)
    ok.init(jax.random.key(0), x)
    r = ok.matmul_report(v, x)
    assert [(op.path, op.kind, op.status) for op in r.excluded_ops()] == [("gram", None,
                                                                            "excluded")]
  # not strict: runs, and the report says what stayed FP32
  r = jf.quantize_model(Outer(), HBFP).matmul_report(v, x, loss_fn=lambda y: y)
  # x @ x.T: both operands have one shape, the backward GEMMs are told apart by their order
  assert sorted((op.path, op.direction) for op in r.unquantized_ops()) == [
      ("gram", "dlhs"), ("gram", "drhs"), ("gram", "fwd")]
  # two Dense: fwd, dlhs, drhs each (jaxlp's backward computes dlhs even for a constant x;
  # XLA drops it)
  assert r.count(status="quantized") == 6

  class NnxRaw(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(5, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
      y = self.fc(x)
      return y.T @ y

  with pytest.raises(ValueError, match=r"dot_general fwd in \(root\): \(4, 3\) x \(3, 4\)"):
    jf.quantize_model(NnxRaw(), HBFP, strict=True, example_args=(x,))
  with pytest.raises(TypeError, match="example_args"):
    jf.quantize_model(NnxRaw(), HBFP, strict=True)
  jf.quantize_model(NnxRaw(), HBFP, strict=True, example_args=(x,), rules=[("", None)])


@FAST
def test_nnx_attention_function_equals_flax_einsum_path():
  """jaxlp's attention (plain dot_generals) == Flax's linen dot_product_attention, with a mask,
  a bias and dropout; grouped-query attention == repeating the key/value heads.

  Eager: both sides run the same primitives, each compiled alone, so the comparison holds at
  any optimization level (FAST); the same function compiled normally, under a policy, is
  compared with Flax's in test_attention_logits_equal_einsum_of_quantized_q_and_k."""
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (2, 5, 4, 8))
  k, v = jax.random.normal(ks[1], (2, 7, 4, 8)), jax.random.normal(ks[2], (2, 7, 4, 8))
  mask = jax.random.bernoulli(ks[3], 0.7, (2, 1, 5, 7))
  bias = jnp.linspace(-1, 1, 35).reshape(1, 1, 5, 7)
  kw = dict(mask=mask, bias=bias, dropout_rng=jax.random.key(5), dropout_rate=0.25,
            deterministic=False)
  # eager: both run the same primitives one by one
  np.testing.assert_array_equal(dot_product_attention(q, k, v, **kw),
                                nn.dot_product_attention(q, k, v, **kw))
  kv2 = (k[:, :, :2], v[:, :, :2])
  rep = tuple(jnp.repeat(t, 2, axis=2) for t in kv2)
  np.testing.assert_allclose(dot_product_attention(q, *kv2, is_causal=True),
                             dot_product_attention(q, *rep, is_causal=True), rtol=1e-6,
                             atol=1e-6)
  with pytest.raises(ValueError, match="multiple"):
    dot_product_attention(q, k[:, :, :3], v[:, :, :3])


@FAST
def test_other_linen_cells_are_recurrent_and_conv_transpose_is_reported():
  """MGUCell, SimpleCell (Dense gates) and ConvLSTMCell (Conv gates) are "recurrent"; a
  ConvTranspose (lax.conv_transpose, no hook) is listed as unquantized and refused by strict."""
  x = jnp.ones((2, 5, 3))
  for cell, gates in ((nn.MGUCell(4), 4), (nn.SimpleCell(4), 2)):
    model = nn.RNN(cell)
    v = jax.eval_shape(model.init, jax.random.key(0), x)
    r = jf.quantize_model(model, {"recurrent": BF16}).matmul_report(v, x, loss_fn=jnp.sum)
    assert r.count(kind="recurrent", status="quantized") == len(r) == 3 * gates
  x4 = jnp.ones((2, 3, 6, 6, 2))
  model = nn.RNN(nn.ConvLSTMCell(3, (3, 3)))
  v = jax.eval_shape(model.init, jax.random.key(0), x4)
  r = jf.quantize_model(model, {"recurrent": BF16}).matmul_report(v, x4)
  assert [(op.primitive, op.kind, op.status) for op in r] == [
      ("conv_general_dilated", "recurrent", "quantized")] * 2
  ct = nn.ConvTranspose(2, (3, 3))
  x2 = jnp.ones((1, 4, 4, 3))
  v = jax.eval_shape(ct.init, jax.random.key(0), x2)
  r = jf.quantize_model(ct, HBFP).matmul_report(v, x2)
  assert [(op.primitive, op.path, op.status) for op in r] == [
      ("conv_general_dilated", "", "unquantized")]
  with pytest.raises(ValueError, match=r"conv_general_dilated fwd in \(root\)"):
    jf.quantize_model(ct, HBFP, strict=True).init(jax.random.key(0), x2)


@FAST
@pytest.mark.parametrize("cell", ["LSTMCell", "OptimizedLSTMCell", "GRUCell"])
def test_nnx_recurrent_cells_through_rnn(cell):
  x = jax.random.normal(jax.random.key(0), (2, 5, 3))
  model = nnx.RNN(getattr(nnx, cell)(3, 4, rngs=nnx.Rngs(0)))
  q = jf.quantize_model(model, {"recurrent": BF16})
  report = jf.matmul_report(q, x, loss_fn=jnp.sum)
  gates = {"LSTMCell": 8, "OptimizedLSTMCell": 2, "GRUCell": 2}[cell]
  graphdef, state = nnx.split(q)
  n = len(matmul_eqns(jax.make_jaxpr(lambda s: nnx.grad(lambda m: jnp.sum(m(x)))(
      nnx.merge(graphdef, s)))(state)))
  assert len(report) == n == 3 * gates and report.count(kind="recurrent", policy=BF16) == 3 * gates
  assert report.count(direction="dlhs") == gates
  y, y0 = nnx.jit(lambda q, m, x: (q(x), m(x)))(q, model, x)
  assert y.shape == (2, 5, 4) and not np.array_equal(y, y0)


@FAST
def test_stochastic_policies_on_every_kind():
  """One layer: every kind (projections, q.k, p.v, MLP, tied logits) with stochastic rounding."""
  pol = float_policy(F.E4M3, F.E5M2, rounding="stochastic")
  model = LinenLM(layers=1)
  v = jax.jit(model.init)(jax.random.key(0), TOKENS)
  q = jf.quantize_model(model, pol)
  f = jax.jit(lambda v, k: q.apply(v, TOKENS, rngs={"quantize": k}))
  a, b, c = f(v, jax.random.key(1)), f(v, jax.random.key(1)), f(v, jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  r = q.matmul_report(v, TOKENS)  # a fixed key is supplied for the trace
  assert r.count(status="quantized") == len(r) == 9
  with pytest.raises(ValueError, match="quantize"):
    jax.eval_shape(lambda v: q.apply(v, TOKENS), v)

  m = NnxLM(nnx.Rngs(0), layers=1)
  with pytest.raises(ValueError, match="rngs"):
    jf.quantize_model(m, {"attention_qk": pol})
  qn = jf.quantize_model(m, pol, rngs=nnx.Rngs(quantize=0))
  step = nnx.jit(lambda m, x: m(x))
  y1, y2 = step(qn, TOKENS), step(qn, TOKENS)  # a fresh key per call: the counter is state
  assert not np.array_equal(y1, y2)
  rn = jf.matmul_report(qn, TOKENS, loss_fn=loss_fn)
  assert rn.count(status="quantized") == len(rn) == 27
  assert type(qn.blocks[0].attn.attention_fn).__name__ == "_StochasticAttentionFn"


@FAST
def test_report_direction_by_order_agrees_with_shapes():
  """Where q and k have the same shape (self-attention) dlhs/drhs are told apart by the order
  of the backward GEMMs; with different lengths (cross-attention) shapes decide: both agree,
  for jaxlp's custom_vjp and for Flax's plain einsum."""
  xq = jax.random.normal(jax.random.key(0), (2, 4, 8))
  xkv = jax.random.normal(jax.random.key(1), (2, 6, 8))
  attn = nn.MultiHeadDotProductAttention(num_heads=2)
  v = attn.init(jax.random.key(2), xq, xkv)
  for policy in (BF16, None):
    q = jf.quantize_model(attn, {"attention_qk": policy, "attention_pv": policy})
    grad = jax.grad(lambda p, a, b, q=q: jnp.sum(q.apply({"params": p}, a, b)), argnums=(0, 1, 2))
    jp = jax.make_jaxpr(lambda p, grad=grad: grad(p, xq, xkv))(v["params"])
    eqns = R.census(jp)
    idents = [R._identity(e) for e in eqns]
    wrapped = lambda ident, policy=policy: ident[0] is not None and policy is not None
    by_shape = R._directions(eqns, idents, wrapped)
    by_order = R._directions(eqns, idents, wrapped, by_shape=False)
    att = [i for i, (k, _) in enumerate(idents) if k in ("attention_qk", "attention_pv")]
    assert [by_shape[i] for i in att] == [by_order[i] for i in att]
    assert sorted(by_shape[i] for i in att) == ["dlhs", "dlhs", "drhs", "drhs", "fwd", "fwd"]


@FAST
def test_patterns_and_rules_that_match_no_module_with_a_matmul_are_errors():
  """Every include/exclude/rules pattern must name a module with a matmul: one jaxlp wraps
  (attention, Embed.attend, cells too), or one an unwrapped matmul is attributed to."""
  v = lm_variables()
  ok = jf.quantize_model(LinenLM(), HBFP, include=("Block_*", "Embed_0"),
                         exclude="Block_1/attn", rules=[("Block_0/attn", BF16)])
  paths = ok.quantized_paths(jax.random.key(0), TOKENS)
  assert {"Block_0/attn", "Embed_0", "Block_1/attn/query"} <= set(paths)
  assert "Block_1/attn" not in paths
  assert ok._patterns_checked
  want = r"matches no layer.*'Block_0/attn', 'Block_0/attn/query'.*'Embed_0'\]"
  # a typo in a rule; a parent's path (patterns match whole paths: "Block_0/*" would do);
  # checked by whichever call completes first, matmul_report included
  for kw, bad in (({"rules": [("Block_0/attn", BF16), ("Block_0/atn", None)]},
                   "rules[1]='Block_0/atn'"),
                  ({"exclude": "Block_0"}, "exclude='Block_0'")):
    for call in (lambda q: q.matmul_report(v, TOKENS),
                 lambda q: q.quantized_paths(jax.random.key(0), TOKENS)):
      with pytest.raises(ValueError, match="(?s)" + re.escape(bad) + " " + want):
        call(jf.quantize_model(LinenLM(), HBFP, **kw))
  # cells: linen's OptimizedLSTMCell is one module; LSTMCell's gates are Dense layers
  x = jnp.ones((2, 5, 3))
  for cell, good, bad in ((nn.OptimizedLSTMCell(4), "cell", "cell/*"),
                          (nn.LSTMCell(4), "cell/*", "cell")):
    q = jf.quantize_model(nn.RNN(cell), {"recurrent": BF16}, rules=[(good, None)])
    assert q.quantized_paths(jax.random.key(0), x) == []
    with pytest.raises(ValueError, match=re.escape(f"rules[0]={bad!r} matches no layer")):
      jf.quantize_model(nn.RNN(cell), BF16, rules=[(bad, None)]).init(jax.random.key(0), x)
  # a module with a raw matmul is a path too (the pattern makes it excluded): found by one
  # marked trace, also under jit; listed in the message
  xo = jnp.ones((3, 5))
  vo = jax.eval_shape(Outer().init, jax.random.key(0), xo)
  q = jf.quantize_model(Outer(), HBFP, exclude="gram")
  jax.eval_shape(jax.jit(q.apply), vo, xo)
  assert q._patterns_checked
  q = jf.quantize_model(Outer(), HBFP, rules=[("gram/Dense_1", None)])
  for _ in range(2):  # refused again: the first call did not complete
    with pytest.raises(ValueError, match=re.escape(
        "rules[0]='gram/Dense_1' matches no layer") + r".*\['gram/Dense_0', 'Dense_0', 'gram'\]"):
      jax.eval_shape(jax.jit(q.apply), vo, xo)

  # nnx: at quantize_model, the same paths (nnx: every Embed), before the model is changed
  m = NnxLM(nnx.Rngs(0), layers=1)
  q = jf.quantize_model(m, HBFP, include=("blocks/0/*", "embed"), exclude="blocks/0/attn",
                        rules=[("blocks/0/fc*", None)])
  assert isinstance(q.blocks[0].fc1.dot_general, R.TaggedOp)
  for kw, bad in (({"rules": [("blocks/0/fc1", None), ("blocks/0/atn", BF16)]},
                   "rules[1]='blocks/0/atn'"),
                  ({"include": "blocks/0"}, "include='blocks/0'")):
    with pytest.raises(ValueError, match=re.escape(bad) + r" matches no layer.*'blocks/0/attn', "
                                         r"'blocks/0/fc1', 'blocks/0/fc2', 'embed'\]"):
      jf.quantize_model(m, HBFP, copy=False, **kw)
    assert m.blocks[0].attn.attention_fn is nnx.dot_product_attention
    assert m.blocks[0].fc1.dot_general is jax.lax.dot_general

  class NnxRaw(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(5, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
      y = self.fc(x)
      return y.T @ y

  # a raw matmul's module is found only by tracing example_args
  with pytest.raises(ValueError, match=r"rules\[0\]='' matches no layer.*\['fc'\].*example_args"):
    jf.quantize_model(NnxRaw(), HBFP, rules=[("", None)])
  q = jf.quantize_model(NnxRaw(), HBFP, rules=[("", None)], example_args=(xo,))
  assert jf.matmul_report(q, xo).excluded_ops()[0].path == ""
  with pytest.raises(ValueError, match=r"exclude='f' matches no layer.*\['fc', ''\]$"):
    jf.quantize_model(NnxRaw(), HBFP, exclude="f", example_args=(xo,))
