"""The language models of jaxlp.flax.models: shapes, causal masking (bit-exact), tied
weights, BERT's 80/10/10 masking statistics, bad input, and whole-model quantization
(every matmul of a training step quantized, none left in fp32).

Every check here holds at any XLA optimization level (shapes, dropout masks, causality and tied
gradients compared among programs compiled in the same test, BERT's masking statistics, the
reports): the module compiles with XLA's optimizations off (``fast_compile``, tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlp
import jaxlp.flax as jf
from jaxlp.flax.models import LSTMLM, BertMLM, TransformerLM, mask_tokens

pytestmark = pytest.mark.usefixtures("fast_compile")

V = 13
KW = {"lstm": dict(features=8), "transformer": dict(features=8, num_heads=2, max_len=12),
      "bert": dict(features=8, num_heads=2, max_len=12)}
CLASSES = {"lstm": LSTMLM, "transformer": TransformerLM, "bert": BertMLM}


def _model(name, **kw):
  return CLASSES[name](V, **(KW[name] | kw))


def _init(model, x):
  return jax.jit(model.init)(jax.random.key(0), x)


def _tokens(shape=(2, 10), seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, V)


@pytest.mark.parametrize("name", ["lstm", "transformer", "bert"])
def test_shapes_and_dropout(name):
  model = _model(name, num_layers=2)

  @jax.jit  # one program: init, eval, and train=True with two dropout keys
  def run(x):
    v = model.init(jax.random.key(0), x)
    drop = lambda k: model.apply(v, x, train=True, rngs={"dropout": jax.random.key(k)})
    return model.apply(v, x), drop(1), drop(2)

  y, a, b = run(_tokens())
  assert y.shape == a.shape == (2, 10, V) and y.dtype == jnp.float32
  assert not np.array_equal(np.asarray(a), np.asarray(b))  # dropout, a mask per key
  assert not np.array_equal(np.asarray(a), np.asarray(y))


@pytest.mark.parametrize("name", ["lstm", "transformer"])
@pytest.mark.parametrize("policy", [None, "e4m3"])
def test_causal_models_do_not_see_the_future(name, policy):
  """The logits at position t do not depend on the tokens after t: bit for bit, in fp32 and
  with every matmul in E4M3 (an elementwise format: no exponent shared across tokens)."""
  model = _model(name)
  x = _tokens((2, 10))
  v = _init(model, x)
  run = model.apply
  if policy:
    run = jf.quantize_model(model, jaxlp.float_policy(jaxlp.formats.E4M3)).apply
  run = jax.jit(run)
  base = np.asarray(run(v, x))
  for t in (0, 4, 8):
    x2 = x.at[:, t + 1:].set((x[:, t + 1:] + 5) % V)
    out = np.asarray(run(v, x2))
    np.testing.assert_array_equal(out[:, :t + 1].view(np.uint32), base[:, :t + 1].view(np.uint32))
    assert not np.array_equal(out[:, t + 1:], base[:, t + 1:])  # the later positions do


def test_bert_sees_both_directions():
  model = _model("bert")
  x = _tokens((2, 10))
  v = _init(model, x)
  apply = jax.jit(model.apply)
  base = np.asarray(apply(v, x))
  out = np.asarray(apply(v, x.at[:, 9].set((x[:, 9] + 1) % V)))
  assert not np.array_equal(out[:, 0], base[:, 0])


@pytest.mark.parametrize("name", ["lstm", "transformer", "bert"])
def test_output_logits_are_tied_to_the_embedding(name):
  """With every input token 0, the embedding rows 1.. get a gradient only through the tied
  output logits (Embed.attend); untied, they get none. One layer: the tying is at the ends."""
  x = jnp.zeros((2, 6), jnp.int32)
  for tied in ((True, False) if name != "bert" else (True,)):
    kw = {} if name == "bert" else {"tied": tied}
    model = _model(name, num_layers=1, **kw)

    @jax.jit
    def init_and_grad(m=model):
      params = m.init(jax.random.key(0), x)["params"]
      loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
          m.apply({"params": p}, x), x).mean()
      return params, jax.grad(loss)(params)

    params, grads = init_and_grad()
    assert ("decoder" in params or "logits" in params) == (not tied)
    g = grads["embed"]["embedding"]
    assert bool(jnp.any(g[1:] != 0)) == tied


def test_bad_tokens_are_refused():
  model = _model("transformer")
  init = lambda m, x: jax.eval_shape(lambda: m.init(jax.random.key(0), x))
  with pytest.raises(ValueError, match="integer array of shape"):
    init(model, jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="exceeds max_len=12"):
    init(model, jnp.zeros((1, 13), jnp.int32))
  with pytest.raises(ValueError, match="not divisible by num_heads"):
    init(TransformerLM(V, features=6, num_heads=4), jnp.zeros((1, 4), jnp.int32))


def test_bert_masking_statistics_with_a_fixed_key():
  """BERT's rule on 200,000 positions: 15% selected; of those 80% -> the mask id, 10% -> a
  uniform random token of 0..num_tokens-1, 10% kept; nothing else changes; the same key gives
  the same masks."""
  n, num_tokens, mask_id = 200_000, 50, 50
  tokens = jax.random.randint(jax.random.key(7), (n,), 0, num_tokens)
  inputs, w = mask_tokens(jax.random.key(3), tokens, mask_id=mask_id, num_tokens=num_tokens)
  inputs, w, tokens = np.asarray(inputs), np.asarray(w), np.asarray(tokens)
  assert w.dtype == np.float32 and set(np.unique(w)) == {0.0, 1.0}
  sel = w == 1
  assert abs(sel.mean() - 0.15) < 0.005  # sd 0.0008
  np.testing.assert_array_equal(inputs[~sel], tokens[~sel])
  masked = inputs[sel] == mask_id
  changed = (inputs[sel] != mask_id) & (inputs[sel] != tokens[sel])
  kept = inputs[sel] == tokens[sel]
  assert abs(masked.mean() - 0.8) < 0.01
  # random replacements equal the original 1 time in num_tokens: 0.1 * (1 - 1/50) change
  assert abs(changed.mean() - 0.1 * (1 - 1 / num_tokens)) < 0.006
  assert abs(kept.mean() - (0.1 + 0.1 / num_tokens)) < 0.006
  assert inputs[sel][~masked].max() < num_tokens  # random tokens are real tokens
  again = mask_tokens(jax.random.key(3), jnp.asarray(tokens), mask_id=mask_id,
                      num_tokens=num_tokens)
  np.testing.assert_array_equal(np.asarray(again[0]), inputs)
  with pytest.raises(ValueError, match="rate"):
    mask_tokens(jax.random.key(0), tokens, mask_id=1, num_tokens=1, rate=1.5)


@pytest.mark.parametrize("name", ["lstm", "transformer", "bert"])
def test_every_matmul_of_a_training_step_is_quantized(name):
  """quantize_model reaches every matmul of the models' loss + gradient step (attention q.k
  and p.v, Embed.attend, the LSTM gates): matmul_report lists none left in fp32."""
  model = _model(name)
  x = _tokens((2, 6))
  v = jax.eval_shape(lambda: model.init(jax.random.key(0), x))
  qm = jf.quantize_model(model, jaxlp.hbfp_policy(8, 24, activations="tiled"), strict=True)
  r = qm.matmul_report(v, x, train=True, rngs={"dropout": jax.random.key(1)},
                       loss_fn=jnp.sum)
  assert len(r) > 0 and r.unquantized_ops() == [] and r.excluded_ops() == []
  kinds = {op.kind for op in r}
  want = {"lstm": {"recurrent", "embed_attend"},
          "transformer": {"dense", "attention_qk", "attention_pv", "embed_attend"},
          "bert": {"dense", "attention_qk", "attention_pv", "embed_attend"}}[name]
  assert kinds == want
