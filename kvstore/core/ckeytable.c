/*
 * kvstore.core.ckeytable -- the block index's key table, its descendant and
 * ancestor marking and the levels of a set of rows, in C (optional).
 *
 * The table is an open-addressing hash table of int32 rows with linear
 * probing (-1 empty, -2 tombstone); a row's key lives in the index's own
 * columns k0/k1 (uint64) and ns (uint32), so the table costs 4 bytes a slot
 * and no Python object exists per block. kvstore/core/keytable.py holds the
 * numpy fallback, which places and finds exactly the same way.
 *
 *   find(table, k0, k1, nscol, state, keys, ns, want_state, stop, out) -> int
 *       Rows of the (n, 2) uint64 ``keys`` in namespace ``ns`` into ``out``
 *       (int64, -1 when absent, or when ``want_state >= 0`` and the row's
 *       state differs). With ``stop`` the scan ends at the first -1 and the
 *       number of leading rows found is returned; else n.
 *   place(table, k0, nscol, rows) -> int
 *       Put rows (int64; keys known absent and distinct) into free slots.
 *       Returns how many empty (not tombstone) slots were taken.
 *   remove(table, k0, nscol, rows) -> None
 *       Tombstone the slots holding these rows (found by identity).
 *   descend(parent, high, roots, mark) -> int
 *       Mark ``roots`` (int64) and every row below one of them: ``mark``
 *       (uint8, zeroed, at least ``high`` long) becomes 1 for those rows and
 *       2 for the other rows below ``high``. One pass over the rows: each
 *       row's parent chain (``parent``, int32, -1 at a chain's first block)
 *       is walked up to the first row already marked and then marked
 *       on the way back, so every row is walked O(1) times. Returns how many
 *       rows are marked 1. The numpy fallback is ``BlockIndex.descend_np``.
 *   levels(parent, rows, out) -> None
 *       For each of ``rows`` (int64, each below len(parent)), how many of
 *       its ancestors are reached going up ``parent`` links within
 *       ``rows`` (0 where its parent is not one of them), into ``out``
 *       (int64). Membership is a position array over the rows' span when
 *       it is dense, else a binary search of the rows sorted. Each row's
 *       chain is walked up to the first row whose level is known (or the
 *       set's top) and its levels are set on the way back: every row is
 *       walked O(1) times. A cycle within ``rows`` is refused. The numpy
 *       fallback is kvstore/core/levels.py ``levels_within``.
 *   ascend(parent, roots, mark) -> int
 *       Mark ``roots`` (int64) and every ancestor of one: ``mark`` (uint8,
 *       zeroed, at least len(parent) long) becomes 1 for them. Each root's
 *       chain is walked up to the first row already marked, so every row is
 *       walked once (a cycle ends there too). Returns how many rows were
 *       marked. The numpy fallback is kvstore/core/levels.py ``ancestors``.
 *
 * Every array must be C-contiguous with the dtype named; the Python side
 * (keytable.py) guarantees that. Rows read from the table are bounds-checked
 * against the columns.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HT_EMPTY (-1)
#define HT_TOMB (-2)
#define HT_MIX 0x9E3779B97F4A7C15ULL

static inline uint64_t
ht_home(uint64_t k0, uint64_t ns, uint64_t mask)
{
    uint64_t h = (k0 ^ (ns * HT_MIX)) * HT_MIX;
    return (h >> 29) & mask;
}

static int
ht_view(PyObject *obj, Py_buffer *v, Py_ssize_t item, int writable, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        return -1;
    }
    if (v->itemsize != item || v->len % item) {
        PyErr_Format(PyExc_TypeError, "%s: expected items of %zd bytes, got %zd", name, item, v->itemsize);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static PyObject *
ht_find(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer tb, k0b, k1b, nsb, stb, qb, ob;
    long long ns, want;
    int stop;
    Py_ssize_t n, i, done;
    (void)self;

    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "find takes 10 arguments");
        return NULL;
    }
    ns = PyLong_AsLongLong(args[6]);
    want = PyLong_AsLongLong(args[7]);
    stop = PyObject_IsTrue(args[8]);
    if (PyErr_Occurred() || stop < 0) {
        return NULL;
    }
    if (ht_view(args[0], &tb, 4, 0, "table") < 0) {
        return NULL;
    }
    if (ht_view(args[1], &k0b, 8, 0, "k0") < 0) {
        goto f0;
    }
    if (ht_view(args[2], &k1b, 8, 0, "k1") < 0) {
        goto f1;
    }
    if (ht_view(args[3], &nsb, 4, 0, "nscol") < 0) {
        goto f2;
    }
    if (ht_view(args[4], &stb, 1, 0, "state") < 0) {
        goto f3;
    }
    if (ht_view(args[5], &qb, 8, 0, "keys") < 0) {
        goto f4;
    }
    if (ht_view(args[9], &ob, 8, 1, "out") < 0) {
        goto f5;
    }
    {
        const int32_t *table = (const int32_t *)tb.buf;
        const uint64_t *k0 = (const uint64_t *)k0b.buf, *k1 = (const uint64_t *)k1b.buf;
        const uint32_t *nscol = (const uint32_t *)nsb.buf;
        const uint8_t *state = (const uint8_t *)stb.buf;
        const uint64_t *q = (const uint64_t *)qb.buf;
        int64_t *out = (int64_t *)ob.buf;
        Py_ssize_t tsize = tb.len / 4, nrows = k0b.len / 8;
        uint64_t mask = (uint64_t)tsize - 1;
        uint32_t ns32 = (uint32_t)ns;

        n = qb.len / 16;
        done = n;
        if (ob.len / 8 < n || k1b.len / 8 < nrows || nsb.len / 4 < nrows || stb.len < nrows
                || (tsize & (tsize - 1)) || tsize == 0) {
            PyErr_SetString(PyExc_ValueError, "find: array sizes disagree");
            goto f6;
        }
        for (i = 0; i < n; i++) {
            uint64_t a = q[2 * i], b = q[2 * i + 1];
            uint64_t pos = ht_home(a, (uint64_t)ns32, mask);
            int64_t found = -1;
            Py_ssize_t probes;
            for (probes = 0; probes < tsize; probes++) {
                int32_t s = table[pos];
                if (s == HT_EMPTY) {
                    break;
                }
                if (s >= 0) {
                    if (s >= nrows) {
                        PyErr_SetString(PyExc_ValueError, "find: table names a row past the columns");
                        goto f6;
                    }
                    if (k0[s] == a && k1[s] == b && nscol[s] == ns32) {
                        found = s;
                        break;
                    }
                }
                pos = (pos + 1) & mask;
            }
            if (found >= 0 && want >= 0 && state[found] != (uint8_t)want) {
                found = -1;
            }
            out[i] = found;
            if (found < 0 && stop) {
                done = i;
                break;
            }
        }
    }
    PyBuffer_Release(&ob);
    PyBuffer_Release(&qb);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&nsb);
    PyBuffer_Release(&k1b);
    PyBuffer_Release(&k0b);
    PyBuffer_Release(&tb);
    return PyLong_FromSsize_t(done);
f6:
    PyBuffer_Release(&ob);
f5:
    PyBuffer_Release(&qb);
f4:
    PyBuffer_Release(&stb);
f3:
    PyBuffer_Release(&nsb);
f2:
    PyBuffer_Release(&k1b);
f1:
    PyBuffer_Release(&k0b);
f0:
    PyBuffer_Release(&tb);
    return NULL;
}

/* Shared by place and remove: (table rw, k0, nscol, rows). */
static int
ht_rows_args(PyObject *const *args, Py_ssize_t nargs, const char *fn, Py_buffer *tb, Py_buffer *k0b,
             Py_buffer *nsb, Py_buffer *rb)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s takes 4 arguments", fn);
        return -1;
    }
    if (ht_view(args[0], tb, 4, 1, "table") < 0) {
        return -1;
    }
    if (ht_view(args[1], k0b, 8, 0, "k0") < 0) {
        goto f0;
    }
    if (ht_view(args[2], nsb, 4, 0, "nscol") < 0) {
        goto f1;
    }
    if (ht_view(args[3], rb, 8, 0, "rows") < 0) {
        goto f2;
    }
    {
        Py_ssize_t tsize = tb->len / 4, nrows = k0b->len / 8, i, n = rb->len / 8;
        const int64_t *rows = (const int64_t *)rb->buf;
        if (tsize == 0 || (tsize & (tsize - 1)) || nsb->len / 4 < nrows) {
            PyErr_Format(PyExc_ValueError, "%s: array sizes disagree", fn);
            goto f3;
        }
        for (i = 0; i < n; i++) {
            if (rows[i] < 0 || rows[i] >= nrows || rows[i] > INT32_MAX) {
                PyErr_Format(PyExc_ValueError, "%s: row %lld out of range", fn, (long long)rows[i]);
                goto f3;
            }
        }
    }
    return 0;
f3:
    PyBuffer_Release(rb);
f2:
    PyBuffer_Release(nsb);
f1:
    PyBuffer_Release(k0b);
f0:
    PyBuffer_Release(tb);
    return -1;
}

static void
ht_release4(Py_buffer *a, Py_buffer *b, Py_buffer *c, Py_buffer *d)
{
    PyBuffer_Release(d);
    PyBuffer_Release(c);
    PyBuffer_Release(b);
    PyBuffer_Release(a);
}

static PyObject *
ht_place(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer tb, k0b, nsb, rb;
    Py_ssize_t i, n, taken = 0, tsize;
    (void)self;

    if (ht_rows_args(args, nargs, "place", &tb, &k0b, &nsb, &rb) < 0) {
        return NULL;
    }
    {
        int32_t *table = (int32_t *)tb.buf;
        const uint64_t *k0 = (const uint64_t *)k0b.buf;
        const uint32_t *nscol = (const uint32_t *)nsb.buf;
        const int64_t *rows = (const int64_t *)rb.buf;
        uint64_t mask;
        tsize = tb.len / 4;
        mask = (uint64_t)tsize - 1;
        n = rb.len / 8;
        for (i = 0; i < n; i++) {
            int64_t r = rows[i];
            uint64_t pos = ht_home(k0[r], (uint64_t)nscol[r], mask);
            Py_ssize_t probes = 0;
            while (table[pos] >= 0) {
                pos = (pos + 1) & mask;
                if (++probes >= tsize) {
                    ht_release4(&tb, &k0b, &nsb, &rb);
                    PyErr_SetString(PyExc_RuntimeError, "place: the key table is full");
                    return NULL;
                }
            }
            taken += table[pos] == HT_EMPTY;
            table[pos] = (int32_t)r;
        }
    }
    ht_release4(&tb, &k0b, &nsb, &rb);
    return PyLong_FromSsize_t(taken);
}

static PyObject *
ht_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer tb, k0b, nsb, rb;
    Py_ssize_t i, n, tsize;
    (void)self;

    if (ht_rows_args(args, nargs, "remove", &tb, &k0b, &nsb, &rb) < 0) {
        return NULL;
    }
    {
        int32_t *table = (int32_t *)tb.buf;
        const uint64_t *k0 = (const uint64_t *)k0b.buf;
        const uint32_t *nscol = (const uint32_t *)nsb.buf;
        const int64_t *rows = (const int64_t *)rb.buf;
        uint64_t mask;
        tsize = tb.len / 4;
        mask = (uint64_t)tsize - 1;
        n = rb.len / 8;
        for (i = 0; i < n; i++) {
            int64_t r = rows[i];
            uint64_t pos = ht_home(k0[r], (uint64_t)nscol[r], mask);
            Py_ssize_t probes = 0;
            while (table[pos] != (int32_t)r) {
                if (table[pos] == HT_EMPTY || ++probes >= tsize) {
                    ht_release4(&tb, &k0b, &nsb, &rb);
                    PyErr_Format(PyExc_AssertionError, "row %lld missing from the key table", (long long)r);
                    return NULL;
                }
                pos = (pos + 1) & mask;
            }
            table[pos] = HT_TOMB;
        }
    }
    ht_release4(&tb, &k0b, &nsb, &rb);
    Py_RETURN_NONE;
}

/* The three buffers of a walk over the parent links: ``parent`` (int32),
 * a row array (int64) and an output (writable, ``out_item`` bytes an item);
 * on failure none is held and an exception is set. */
static int
ht_tree_views(PyObject *parent, PyObject *rows, const char *rows_name, PyObject *out,
              Py_ssize_t out_item, const char *out_name, Py_buffer *pb, Py_buffer *rb, Py_buffer *ob)
{
    if (ht_view(parent, pb, 4, 0, "parent") < 0) {
        return -1;
    }
    if (ht_view(rows, rb, 8, 0, rows_name) < 0) {
        PyBuffer_Release(pb);
        return -1;
    }
    if (ht_view(out, ob, out_item, 1, out_name) < 0) {
        PyBuffer_Release(rb);
        PyBuffer_Release(pb);
        return -1;
    }
    return 0;
}

static PyObject *
ht_descend(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer pb, rb, mb;
    Py_ssize_t high, i, n, count = 0;
    (void)self;

    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "descend takes 4 arguments");
        return NULL;
    }
    high = PyLong_AsSsize_t(args[1]);
    if (high == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (ht_tree_views(args[0], args[2], "roots", args[3], 1, "mark", &pb, &rb, &mb) < 0) {
        return NULL;
    }
    {
        const int32_t *parent = (const int32_t *)pb.buf;
        const int64_t *roots = (const int64_t *)rb.buf;
        uint8_t *mark = (uint8_t *)mb.buf;
        if (high < 0 || pb.len / 4 < high || mb.len < high) {
            PyErr_SetString(PyExc_ValueError, "descend: array sizes disagree");
            goto fail;
        }
        n = rb.len / 8;
        for (i = 0; i < n; i++) {
            int64_t r = roots[i];
            if (r < 0 || r >= high) {
                PyErr_Format(PyExc_ValueError, "descend: root %lld out of range", (long long)r);
                goto fail;
            }
            if (mark[r] != 1) {
                mark[r] = 1;
                count++;
            }
        }
        for (i = 0; i < high; i++) {
            int32_t x = (int32_t)i, p;
            uint8_t res;
            Py_ssize_t steps = 0;
            if (mark[i]) {
                continue;
            }
            for (;;) {  /* up to the first marked row, or past a chain's first block */
                p = parent[x];
                if (p < 0) {
                    res = 2;
                    break;
                }
                if (p >= high || ++steps > high) {
                    PyErr_SetString(PyExc_ValueError, "descend: a parent past the rows, or a cycle");
                    goto fail;
                }
                if (mark[p]) {
                    res = mark[p];
                    break;
                }
                x = p;
            }
            for (x = (int32_t)i; x >= 0 && !mark[x]; x = parent[x]) {  /* the same rows again */
                mark[x] = res;
                count += res == 1;
            }
        }
    }
    PyBuffer_Release(&mb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&pb);
    return PyLong_FromSsize_t(count);
fail:
    PyBuffer_Release(&mb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&pb);
    return NULL;
}

/* levels: membership in the set of rows, by position array (dense) or binary search (sparse). */
typedef struct {
    int64_t row;
    int64_t at;
} lv_pair;

typedef struct {
    int64_t lo, hi;
    const int32_t *pos;     /* dense: position of row lo + k, or -1 */
    const lv_pair *srt;     /* sparse: the rows sorted */
    Py_ssize_t n;
} lv_set;

static int
lv_cmp(const void *a, const void *b)
{
    int64_t x = ((const lv_pair *)a)->row, y = ((const lv_pair *)b)->row;
    return (x > y) - (x < y);
}

static inline int64_t
lv_member(const lv_set *s, int64_t p)
{
    Py_ssize_t a = 0, b;
    if (p < s->lo || p > s->hi) {
        return -1;
    }
    if (s->pos != NULL) {
        return s->pos[p - s->lo];
    }
    b = s->n;
    while (a < b) {
        Py_ssize_t m = a + (b - a) / 2;
        if (s->srt[m].row < p) {
            a = m + 1;
        } else {
            b = m;
        }
    }
    return (a < s->n && s->srt[a].row == p) ? s->srt[a].at : -1;
}

static PyObject *
ht_levels(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer pb, rb, ob;
    Py_ssize_t n, npar, i;
    int32_t *pos = NULL;
    lv_pair *srt = NULL;
    PyObject *ret = NULL;
    (void)self;

    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "levels takes 3 arguments");
        return NULL;
    }
    if (ht_tree_views(args[0], args[1], "rows", args[2], 8, "out", &pb, &rb, &ob) < 0) {
        return NULL;
    }
    {
        const int32_t *parent = (const int32_t *)pb.buf;
        const int64_t *rows = (const int64_t *)rb.buf;
        int64_t *lev = (int64_t *)ob.buf;
        lv_set s;
        n = rb.len / 8;
        npar = pb.len / 4;
        if (ob.len / 8 < n) {
            PyErr_SetString(PyExc_ValueError, "levels: out is shorter than rows");
            goto done;
        }
        if (n == 0) {
            ret = Py_None;
            goto done;
        }
        s.lo = rows[0];
        s.hi = rows[0];
        s.n = n;
        s.pos = NULL;
        s.srt = NULL;
        for (i = 0; i < n; i++) {
            int64_t r = rows[i];
            if (r < 0 || r >= npar) {
                PyErr_Format(PyExc_ValueError, "levels: row %lld out of range", (long long)r);
                goto done;
            }
            s.lo = r < s.lo ? r : s.lo;
            s.hi = r > s.hi ? r : s.hi;
            lev[i] = -1;
        }
        if (s.hi - s.lo < 4 * (int64_t)n + 4096) {  /* dense: a position per row of the span */
            pos = n > INT32_MAX ? NULL : PyMem_Malloc((size_t)(s.hi - s.lo + 1) * sizeof(int32_t));
            if (pos == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memset(pos, 0xff, (size_t)(s.hi - s.lo + 1) * sizeof(int32_t));
            for (i = 0; i < n; i++) {
                pos[rows[i] - s.lo] = (int32_t)i;
            }
            s.pos = pos;
        } else {
            srt = PyMem_Malloc((size_t)n * sizeof(lv_pair));
            if (srt == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            for (i = 0; i < n; i++) {
                srt[i].row = rows[i];
                srt[i].at = i;
            }
            qsort(srt, (size_t)n, sizeof(lv_pair), lv_cmp);
            s.srt = srt;
        }
        for (i = 0; i < n; i++) {
            int64_t x = i, j, end, top;
            Py_ssize_t hops = 0;
            if (lev[i] >= 0) {
                continue;
            }
            for (;;) {  /* up to the set's top or the first row whose level is known */
                j = lv_member(&s, parent[rows[x]]);
                if (j < 0) {
                    end = x;
                    top = 0;
                    break;
                }
                if (++hops > n) {
                    PyErr_SetString(PyExc_ValueError, "levels: the parent links form a cycle");
                    goto done;
                }
                if (lev[j] >= 0) {
                    end = j;
                    top = lev[j];
                    break;
                }
                x = j;
            }
            lev[end] = top;
            for (x = i; x != end; x = lv_member(&s, parent[rows[x]])) {  /* the same rows again */
                lev[x] = top + hops--;
            }
        }
        ret = Py_None;
    }
done:
    PyMem_Free(pos);
    PyMem_Free(srt);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&pb);
    Py_XINCREF(ret);
    return ret;
}

static PyObject *
ht_ascend(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer pb, rb, mb;
    Py_ssize_t i, n, npar, count = 0;
    PyObject *ret = NULL;
    (void)self;

    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "ascend takes 3 arguments");
        return NULL;
    }
    if (ht_tree_views(args[0], args[1], "roots", args[2], 1, "mark", &pb, &rb, &mb) < 0) {
        return NULL;
    }
    {
        const int32_t *parent = (const int32_t *)pb.buf;
        const int64_t *roots = (const int64_t *)rb.buf;
        uint8_t *mark = (uint8_t *)mb.buf;
        npar = pb.len / 4;
        n = rb.len / 8;
        if (mb.len < npar) {
            PyErr_SetString(PyExc_ValueError, "ascend: mark is shorter than parent");
            goto done;
        }
        for (i = 0; i < n; i++) {
            int64_t x = roots[i];
            if (x < 0 || x >= npar) {
                PyErr_Format(PyExc_ValueError, "ascend: root %lld out of range", (long long)x);
                goto done;
            }
            while (x >= 0 && !mark[x]) {  /* up to the first row marked, or past a chain's first block */
                mark[x] = 1;
                count++;
                x = parent[x];
                if (x >= npar) {
                    PyErr_SetString(PyExc_ValueError, "ascend: a parent past the rows");
                    goto done;
                }
            }
        }
        ret = PyLong_FromSsize_t(count);
    }
done:
    PyBuffer_Release(&mb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&pb);
    return ret;
}

static PyMethodDef ht_methods[] = {
    {"find", (PyCFunction)(void (*)(void))ht_find, METH_FASTCALL,
     "find(table, k0, k1, nscol, state, keys, ns, want_state, stop, out) -> int"},
    {"place", (PyCFunction)(void (*)(void))ht_place, METH_FASTCALL,
     "place(table, k0, nscol, rows) -> empty slots taken"},
    {"remove", (PyCFunction)(void (*)(void))ht_remove, METH_FASTCALL,
     "remove(table, k0, nscol, rows) -> None"},
    {"descend", (PyCFunction)(void (*)(void))ht_descend, METH_FASTCALL,
     "descend(parent, high, roots, mark) -> rows marked 1 (roots and their descendants)"},
    {"levels", (PyCFunction)(void (*)(void))ht_levels, METH_FASTCALL,
     "levels(parent, rows, out) -> None: each row's ancestors reached within rows"},
    {"ascend", (PyCFunction)(void (*)(void))ht_ascend, METH_FASTCALL,
     "ascend(parent, roots, mark) -> rows marked (roots and their ancestors)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ht_module = {
    PyModuleDef_HEAD_INIT, "kvstore.core.ckeytable",
    "The block index's key table (open addressing, linear probing) in C.", -1, ht_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit_ckeytable(void)
{
    return PyModule_Create(&ht_module);
}
