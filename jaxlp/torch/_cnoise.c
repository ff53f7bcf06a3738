/* jaxlp.torch._cnoise: the stochastic noise words of the torch bridge's CPU path, in C.
 *
 * An optional accelerator of jaxlp/torch/_cpu.py (built by setup.py where a C compiler is
 * found; without it the NumPy code there runs). It computes exactly what _cpu.py's
 * `_threefry_words` and `noise` compute, which are the JAX spec's definitions:
 *
 *   words(w0, w1)      jax.random.bits(key, (2,), uint32) of a threefry2x32 key with data
 *                      (w0, w1), in JAX's partitionable scheme: Threefry-2x32 (20 rounds) of the
 *                      counters (0, 0) and (0, 1), each output pair XORed.
 *   fill(out, k0, k1)  out[i] = hash_bits(k0, k1, i) = fmix32(fmix32(i * 0x9E3779B9 ^ k0) ^ k1)
 *                      for every uint32 element i of the writable buffer `out`
 *                      (jaxlp/formats/_bits.py).
 *   fill_drawn(out, w0, w1)  fill(out, *words(w0, w1)): one call for a fresh draw.
 *   scaled_stochastic(out, bits, rand, up, down)  fixed point's stochastic rounding on the
 *                      fast path of _cpu.py's `_scaled` (see that function below).
 *
 * tests/torch_bridge/test_cpu_noise_c.py compares every function with the NumPy code and JAX.
 *
 * References:
 *   Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011 (Threefry-2x32:
 *   rotation constants 13 15 26 6 / 17 29 16 24, key schedule with 0x1BD11BDA).
 *   Austin Appleby, MurmurHash3 (public domain): the fmix32 finaliser.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

static inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

#define MIX4(r0, r1, r2, r3)                 \
  x0 += x1; x1 = rotl32(x1, r0) ^ x0;        \
  x0 += x1; x1 = rotl32(x1, r1) ^ x0;        \
  x0 += x1; x1 = rotl32(x1, r2) ^ x0;        \
  x0 += x1; x1 = rotl32(x1, r3) ^ x0;

/* Threefry-2x32 (20 rounds) of counter (0, j) under key (a, b), the output words XORed. */
static uint32_t threefry_lane(uint32_t a, uint32_t b, uint32_t j) {
  const uint32_t c = a ^ b ^ 0x1BD11BDAu;
  uint32_t x0 = a, x1 = b + j;
  MIX4(13, 15, 26, 6) x0 += b; x1 += c + 1u;
  MIX4(17, 29, 16, 24) x0 += c; x1 += a + 2u;
  MIX4(13, 15, 26, 6) x0 += a; x1 += b + 3u;
  MIX4(17, 29, 16, 24) x0 += b; x1 += c + 4u;
  MIX4(13, 15, 26, 6) x0 += c; x1 += a + 5u;
  return x0 ^ x1;
}

static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

/* A Python int in [0, 2**32) as uint32, or -1 with an exception set. */
static int as_u32(PyObject *o, uint32_t *out) {
  unsigned long long v;
  if (!PyLong_Check(o)) {
    PyErr_Format(PyExc_TypeError, "jaxlp.torch._cnoise: a key word must be an int, got %.100s",
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "jaxlp.torch._cnoise: a key word must be in [0, 2**32)");
    return -1;
  }
  if (v > 0xFFFFFFFFull) {
    PyErr_SetString(PyExc_ValueError, "jaxlp.torch._cnoise: a key word must be in [0, 2**32)");
    return -1;
  }
  *out = (uint32_t)v;
  return 0;
}

/* Fills the writable buffer `o` (uint32 elements) with the noise words under (k0, k1). */
static PyObject *fill_buffer(PyObject *o, uint32_t k0, uint32_t k1) {
  Py_buffer view;
  uint32_t *p;
  Py_ssize_t n, i;
  if (PyObject_GetBuffer(o, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
  if (view.len % 4 != 0 || view.len / 4 > (Py_ssize_t)0xFFFFFFFFll) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError,
                    "jaxlp.torch._cnoise: out must hold at most 2**32 - 1 uint32 elements");
    return NULL;
  }
  p = (uint32_t *)view.buf;
  n = view.len / 4;
  if (n > 65536) {
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) p[i] = fmix32(fmix32(((uint32_t)i * 0x9E3779B9u) ^ k0) ^ k1);
    Py_END_ALLOW_THREADS
  } else {
    for (i = 0; i < n; i++) p[i] = fmix32(fmix32(((uint32_t)i * 0x9E3779B9u) ^ k0) ^ k1);
  }
  PyBuffer_Release(&view);
  Py_RETURN_NONE;
}

static PyObject *cn_words(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  uint32_t w0, w1;
  (void)self;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "jaxlp.torch._cnoise.words takes (w0, w1)");
    return NULL;
  }
  if (as_u32(args[0], &w0) < 0 || as_u32(args[1], &w1) < 0) return NULL;
  return Py_BuildValue("(kk)", (unsigned long)threefry_lane(w0, w1, 0u),
                       (unsigned long)threefry_lane(w0, w1, 1u));
}

static PyObject *cn_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  uint32_t k0, k1;
  (void)self;
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "jaxlp.torch._cnoise.fill takes (out, k0, k1)");
    return NULL;
  }
  if (as_u32(args[1], &k0) < 0 || as_u32(args[2], &k1) < 0) return NULL;
  return fill_buffer(args[0], k0, k1);
}

static PyObject *cn_fill_drawn(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  uint32_t w0, w1;
  (void)self;
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "jaxlp.torch._cnoise.fill_drawn takes (out, w0, w1)");
    return NULL;
  }
  if (as_u32(args[1], &w0) < 0 || as_u32(args[2], &w1) < 0) return NULL;
  return fill_buffer(args[0], threefry_lane(w0, w1, 0u), threefry_lane(w0, w1, 1u));
}

/* scaled_stochastic(out, bits, rand, up, down): _cpu.py's `_scaled` stochastic core, i.e. for
 * float32 x = bits[i]: y = |x| * up, n = floor(y), n += rand[i] < (uint32)((y - n) * 2**32),
 * out[i] = copysign(n * down, x), each operation in float32 as NumPy evaluates it there (no
 * contraction: setup.py compiles with -ffp-contract=off). The caller guarantees what that
 * fast path does: every |x| * up finite (so the threshold is below 2**32), the scales powers
 * of two, and subnormals kept by the arithmetic (the same MXCSR as NumPy's). */
static PyObject *cn_scaled_stochastic(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Py_buffer o, b, r;
  double upd, downd;
  float up, down;
  Py_ssize_t n, i;
  PyObject *res = NULL;
  (void)self;
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "jaxlp.torch._cnoise.scaled_stochastic takes (out, bits, rand, up, down)");
    return NULL;
  }
  upd = PyFloat_AsDouble(args[3]);
  if (upd == -1.0 && PyErr_Occurred()) return NULL;
  downd = PyFloat_AsDouble(args[4]);
  if (downd == -1.0 && PyErr_Occurred()) return NULL;
  up = (float)upd;
  down = (float)downd;
  if (PyObject_GetBuffer(args[0], &o, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
  if (PyObject_GetBuffer(args[1], &b, PyBUF_C_CONTIGUOUS) < 0) {
    PyBuffer_Release(&o);
    return NULL;
  }
  if (PyObject_GetBuffer(args[2], &r, PyBUF_C_CONTIGUOUS) < 0) {
    PyBuffer_Release(&b);
    PyBuffer_Release(&o);
    return NULL;
  }
  if (o.len % 4 != 0 || b.len != o.len || r.len != o.len) {
    PyErr_SetString(PyExc_ValueError,
                    "jaxlp.torch._cnoise.scaled_stochastic: out, bits and rand must hold the "
                    "same number of 4-byte elements");
    goto done;
  }
  n = o.len / 4;
  {
    float *po = (float *)o.buf;
    const float *pb = (const float *)b.buf;
    const uint32_t *pr = (const uint32_t *)r.buf;
    for (i = 0; i < n; i++) {
      float x = pb[i];
      float y = fabsf(x) * up;
      float f = floorf(y);
      float t = (y - f) * 4294967296.0f;
      if (pr[i] < (uint32_t)t) f += 1.0f;
      f *= down;
      po[i] = copysignf(f, x);
    }
  }
  Py_INCREF(Py_None);
  res = Py_None;
done:
  PyBuffer_Release(&r);
  PyBuffer_Release(&b);
  PyBuffer_Release(&o);
  return res;
}

static PyMethodDef cn_methods[] = {
    {"scaled_stochastic", (PyCFunction)(void (*)(void))cn_scaled_stochastic, METH_FASTCALL,
     "scaled_stochastic(out, bits, rand, up, down): fixed point's stochastic rounding onto the "
     "grid up**-1 (see jaxlp/torch/_cpu.py _scaled)."},
    {"words", (PyCFunction)(void (*)(void))cn_words, METH_FASTCALL,
     "words(w0, w1) -> (k0, k1): jax.random.bits(key, (2,), uint32) of threefry key data "
     "(w0, w1)."},
    {"fill", (PyCFunction)(void (*)(void))cn_fill, METH_FASTCALL,
     "fill(out, k0, k1): out[i] = hash_bits(k0, k1, i) for each uint32 element of out."},
    {"fill_drawn", (PyCFunction)(void (*)(void))cn_fill_drawn, METH_FASTCALL,
     "fill_drawn(out, w0, w1): fill(out, *words(w0, w1))."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef cn_module = {
    PyModuleDef_HEAD_INIT, "_cnoise",
    "The torch bridge's stochastic noise words in C (see jaxlp/torch/_cpu.py).", -1,
    cn_methods};

PyMODINIT_FUNC PyInit__cnoise(void) { return PyModule_Create(&cn_module); }
