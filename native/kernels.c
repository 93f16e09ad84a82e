/*
 * irdmafs._native: the PS arithmetic that numpy does in several passes, in one.
 *
 *   acc_f16(acc, src[, vector])       acc[i] += (float)src[i]       fp16 push -> fp32 sum
 *   sgd(param, grad, buf, lr, momentum, weight_decay, nesterov, first, div)
 *   adam(param, grad, m, v, lr, b1, b2, eps, weight_decay, c1, c2, div)
 *   f16c()                            whether acc_f16 converts with F16C here
 *
 * Every array is a contiguous float32 buffer (float16 for src), updated in place; buf may be
 * None when momentum is 0. The operations are the ones irdmafs/server/optim.py does, in the same
 * order, each rounded to float32 (built with -ffp-contract=off: no fused multiply-add), so the
 * results are bit-identical to the numpy fallback, which the tests check. numpy needs a
 * temporary array and a pass over memory per operation; here each element is loaded and stored
 * once. ``div`` is the round's averaging: the gradient read is grad[i] / div (a bsp round's sum
 * and its count of pushes, an asp push and W), the division numpy does as a pass of its own
 * before the step. c1 and c2 are Adam's bias corrections 1 - b1^t and 1 - b2^t, computed by the
 * caller so that both paths use the same float32 values.
 *
 * acc_f16 converts eight halves at a time with F16C where the CPU has it (chosen at run time,
 * never -march=native: the module runs on whatever machine imports it), else one at a time.
 * F16C's conversion quiets a signalling NaN, the scalar one keeps its bits; the sum quiets it in
 * both (an IEEE add returns a NaN operand quieted), so acc ends with the same bits either way;
 * which NaN a sum of two keeps is add_keep_nan's rule, the same in both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_X86 1
#endif

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;  /* +-0 */
        } else {          /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  /* inf, nan */
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A writable (or read-only) contiguous buffer of items of size itemsize, aligned to them. */
static int get(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, not %zd", what, view->itemsize, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    if ((uintptr_t)view->buf % (uintptr_t)itemsize != 0) {  /* a load through it would be undefined */
        PyErr_Format(PyExc_ValueError, "%s: not aligned to its %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* out + h as numpy's ``acc += x`` gives it, NaNs included: IEEE leaves open which NaN operand an
 * add returns, and the compiler may swap a commutative add's operands, so the rule is explicit:
 * a NaN sum stays its own NaN, quieted (numpy's loop returns its first operand's); else the add,
 * which returns the one NaN operand quieted if the gradient is one. */
static inline float add_keep_nan(float o, float h) {
    if (o != o) {
        uint32_t bits;
        memcpy(&bits, &o, sizeof bits);
        bits |= 0x00400000u;  /* the quiet bit */
        memcpy(&o, &bits, sizeof o);
        return o;
    }
    return o + h;
}

static void acc_f16_scalar(float *out, const uint16_t *in, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) out[i] = add_keep_nan(out[i], half_to_float(in[i]));
}

#ifdef HAVE_X86
__attribute__((target("avx,f16c"))) static void acc_f16_vector(float *out, const uint16_t *in, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 h = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i)));
        __m256 o = _mm256_loadu_ps(out + i);
        __m256 nan = _mm256_cmp_ps(o, o, _CMP_UNORD_Q);  /* add_keep_nan, eight at a time */
        __m256 quiet = _mm256_or_ps(o, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_add_ps(o, h), quiet, nan));
    }
    acc_f16_scalar(out + i, in + i, n - i);
}

/* CPUID leaf 1: F16C and AVX, and OSXSAVE with XCR0 saying the OS keeps the YMM state (gcc's
 * and clang's __builtin_cpu_supports do not both know "f16c"). */
static int has_f16c(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & bit_OSXSAVE) || !(c & bit_AVX) || !(c & bit_F16C)) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 6u) == 6u;  /* XMM and YMM state */
}
#else
static void acc_f16_vector(float *out, const uint16_t *in, Py_ssize_t n) { acc_f16_scalar(out, in, n); }
static int has_f16c(void) { return 0; }
#endif

static int use_f16c;  /* set once at import */

static PyObject *acc_f16(PyObject *self, PyObject *args) {
    PyObject *a, *s;
    int vector = 1;
    Py_buffer acc, src;
    if (!PyArg_ParseTuple(args, "OO|p", &a, &s, &vector)) return NULL;
    if (get(a, &acc, 1, 4, "acc") < 0) return NULL;
    if (get(s, &src, 0, 2, "src") < 0) { PyBuffer_Release(&acc); return NULL; }
    Py_ssize_t n = acc.len / 4;
    if (src.len / 2 != n) {
        PyErr_SetString(PyExc_ValueError, "acc and src differ in length");
    } else {
        float *out = acc.buf;
        const uint16_t *in = src.buf;
        int simd = vector && use_f16c;
        Py_BEGIN_ALLOW_THREADS
        if (simd)
            acc_f16_vector(out, in, n);
        else
            acc_f16_scalar(out, in, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&acc);
    PyBuffer_Release(&src);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *f16c(PyObject *self, PyObject *args) { return PyBool_FromLong(use_f16c); }

static PyObject *sgd(PyObject *self, PyObject *args) {
    PyObject *po, *go, *bo;
    float lr, mom, wd, div;
    int nesterov, first;
    Py_buffer p, g, b = {0};
    if (!PyArg_ParseTuple(args, "OOOfffppf", &po, &go, &bo, &lr, &mom, &wd, &nesterov, &first, &div)) return NULL;
    if (get(po, &p, 1, 4, "param") < 0) return NULL;
    if (get(go, &g, 0, 4, "grad") < 0) { PyBuffer_Release(&p); return NULL; }
    int has_buf = bo != Py_None;
    if (has_buf && get(bo, &b, 1, 4, "buf") < 0) { PyBuffer_Release(&p); PyBuffer_Release(&g); return NULL; }
    Py_ssize_t n = p.len / 4;
    if (g.len / 4 != n || (has_buf && b.len / 4 != n) || (mom != 0.0f) != has_buf) {
        PyErr_SetString(PyExc_ValueError, "param, grad and buf differ in length, or buf does not match momentum");
    } else if (!(div >= 1.0f)) {
        PyErr_SetString(PyExc_ValueError, "div is a count of pushes, at least 1");
    } else {
        float *pp = p.buf, *bb = has_buf ? b.buf : NULL;
        const float *gg = g.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            float x = gg[i] / div;
            if (wd != 0.0f) x = x + wd * pp[i];
            if (bb) {
                float v = first ? x : bb[i] * mom + x;
                bb[i] = v;
                x = nesterov ? x + mom * v : v;
            }
            pp[i] = pp[i] - lr * x;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&p);
    PyBuffer_Release(&g);
    if (has_buf) PyBuffer_Release(&b);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *adam(PyObject *self, PyObject *args) {
    PyObject *po, *go, *mo, *vo;
    float lr, b1, b2, eps, wd, c1, c2, div;
    Py_buffer p, g, m, v;
    if (!PyArg_ParseTuple(args, "OOOOffffffff", &po, &go, &mo, &vo, &lr, &b1, &b2, &eps, &wd, &c1, &c2, &div)) return NULL;
    if (get(po, &p, 1, 4, "param") < 0) return NULL;
    if (get(go, &g, 0, 4, "grad") < 0) { PyBuffer_Release(&p); return NULL; }
    if (get(mo, &m, 1, 4, "m") < 0) { PyBuffer_Release(&p); PyBuffer_Release(&g); return NULL; }
    if (get(vo, &v, 1, 4, "v") < 0) { PyBuffer_Release(&p); PyBuffer_Release(&g); PyBuffer_Release(&m); return NULL; }
    Py_ssize_t n = p.len / 4;
    if (g.len / 4 != n || m.len / 4 != n || v.len / 4 != n) {
        PyErr_SetString(PyExc_ValueError, "param, grad, m and v differ in length");
    } else if (!(div >= 1.0f)) {
        PyErr_SetString(PyExc_ValueError, "div is a count of pushes, at least 1");
    } else {
        float *pp = p.buf, *mm = m.buf, *vv = v.buf;
        const float *gg = g.buf;
        const float one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            float x = gg[i] / div;
            if (wd != 0.0f) x = x + wd * pp[i];
            float mi = mm[i] * b1 + one_b1 * x;
            float vi = vv[i] * b2 + (one_b2 * x) * x;
            mm[i] = mi;
            vv[i] = vi;
            float mhat = mi / c1, vhat = vi / c2;
            pp[i] = pp[i] - (lr * mhat) / (sqrtf(vhat) + eps);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&p);
    PyBuffer_Release(&g);
    PyBuffer_Release(&m);
    PyBuffer_Release(&v);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"acc_f16", acc_f16, METH_VARARGS, "acc += float32(src), src float16, in one pass (vector: F16C where the CPU has it)"},
    {"sgd", sgd, METH_VARARGS, "SGD (momentum, Nesterov, weight decay) of grad / div in one pass"},
    {"adam", adam, METH_VARARGS, "Adam (weight decay) of grad / div in one pass"},
    {"f16c", f16c, METH_NOARGS, "whether acc_f16 converts with F16C on this CPU"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "irdmafs PS kernels in C", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    use_f16c = has_f16c();
    return PyModule_Create(&module);
}
