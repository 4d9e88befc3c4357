/*
 * embd._client - the C extension under the embd package: a Client type over one
 * libembdclient handle (include/embd/client.h) and a Span type, one buffer of a batch slot
 * lent to numpy through the buffer protocol. embd/client.py builds the public API on these.
 *
 * The one idea: a slot's buffers live in the region libembdclient maps, so no view of them may
 * outlive the mapping. Every Span holds a reference to its Client and counts its live buffer
 * exports there; close() refuses while one is alive, and otherwise the mapping goes only with
 * the last reference. With device outputs in CUDA memory (device_outputs) a slot's pooled and
 * grad Spans are device memory: no buffer protocol, but __cuda_array_interface__ (torch,
 * CuPy and Numba view them without a copy), and since a consumer such as torch keeps the Span
 * itself alive, not a buffer export, such a Span counts as an export for as long as it lives. Blocking calls release the GIL and wait in slices, so Ctrl-C and other
 * threads get through; a busy flag, read and written only under the GIL, keeps a second
 * thread off a handle whose call runs without it (the C API asks callers to serialise).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "embd/client.h"

/* Longest sleep between two looks at Python's signals while a call waits. */
#define WAIT_SLICE_MS 100
/* Blocking calls tag their requests' user_data so that a completion of one given up on
 * (Ctrl-C, a timeout) is recognised and dropped when it arrives later. */
#define BLOCKING_TAG (1ull << 63)

typedef struct {
	PyObject_HEAD
	struct embd_client *client;    /* NULL once closed */
	Py_ssize_t exports;            /* live buffer exports of this client's spans */
	int busy;                      /* a call on this handle runs without the GIL */
	int device_memory;             /* pooled and grad are CUDA memory (device_outputs) */
	uint64_t next_user_data;       /* of blocking calls, below BLOCKING_TAG */
	uint64_t abandoned_through;    /* blocking requests up to this tag were given up on */
} ClientObject;

typedef struct {
	PyObject_HEAD
	ClientObject *owner;
	char *buf;
	int device;                    /* CUDA memory: __cuda_array_interface__, no buffer */
	char format[2];
	int ndim;
	Py_ssize_t itemsize;
	Py_ssize_t shape[2];
	Py_ssize_t strides[2];
} SpanObject;

static PyTypeObject ClientType;
static PyTypeObject SpanType;

/* ---- errors ----------------------------------------------------------------------------- */

/*
 * Sets the embd.errors exception for an EMBD_E* code and returns NULL. step: the step of the
 * service's completion that carried the code, or -1 for a failure of this process's own
 * (Error.step is then None).
 */
static PyObject *raise_step(int code, const char *message, long long step)
{
	PyObject *mod = PyImport_ImportModule("embd.errors");
	if (!mod)
		return NULL;
	PyObject *text = PyUnicode_DecodeUTF8(message, (Py_ssize_t)strlen(message), "replace");
	PyObject *st = step < 0 ? Py_None : PyLong_FromLongLong(step);
	if (st == Py_None)
		Py_INCREF(st);
	PyObject *exc = text && st ? PyObject_CallMethod(mod, "error_for", "iOO", code, text, st)
				   : NULL;
	Py_XDECREF(st);
	Py_XDECREF(text);
	Py_DECREF(mod);
	if (exc) {
		PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
		Py_DECREF(exc);
	}
	return NULL;
}

static PyObject *raise_code(int code, const char *message)
{
	return raise_step(code, message, -1);
}

static PyObject *raise_client(ClientObject *self, int code)
{
	return raise_code(code, embd_last_error(self->client));
}

/* 0 when the handle may be used now; else -1 with the error set. */
static int usable(ClientObject *self)
{
	if (!self->client) {
		raise_code(EMBD_EINVAL, "client: closed");
		return -1;
	}
	if (self->busy) {
		raise_code(EMBD_EBUSY, "client: a call on this client runs in another thread (calls "
			   "on one client must not overlap)");
		return -1;
	}
	return 0;
}

/* ---- Span: one buffer of a slot -------------------------------------------------------- */

static int span_getbuffer(PyObject *obj, Py_buffer *view, int flags)
{
	SpanObject *s = (SpanObject *)obj;

	if (!s->owner->client) {
		raise_code(EMBD_EINVAL, "client: closed, its batch slots are gone");
		return -1;
	}
	if (s->device) {
		PyErr_SetString(PyExc_BufferError, "span: CUDA device memory (device outputs): view "
				"it with torch.as_tensor(span, device='cuda'), not on the host");
		return -1;
	}
	Py_ssize_t n = 1;
	for (int i = 0; i < s->ndim; i++)
		n *= s->shape[i];
	view->obj = obj;
	Py_INCREF(obj);
	view->buf = s->buf;
	view->len = n * s->itemsize;
	view->readonly = 0;
	view->itemsize = s->itemsize;
	view->format = (flags & PyBUF_FORMAT) ? s->format : NULL;
	view->ndim = s->ndim;
	view->shape = (flags & PyBUF_ND) ? s->shape : NULL;
	view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? s->strides : NULL;
	view->suboffsets = NULL;
	view->internal = NULL;
	s->owner->exports++;
	return 0;
}

static void span_releasebuffer(PyObject *obj, Py_buffer *view)
{
	(void)view;
	((SpanObject *)obj)->owner->exports--;
}

static void span_dealloc(PyObject *obj)
{
	SpanObject *s = (SpanObject *)obj;

	if (s->device && s->owner)
		s->owner->exports--;
	Py_XDECREF(s->owner);
	Py_TYPE(obj)->tp_free(obj);
}

/* The CUDA Array Interface (version 3) of a device span: shape, float32, its device pointer,
 * no stream (the memory is complete once the request that wrote it completed). */
static PyObject *span_cuda_array_interface(PyObject *obj, void *closure)
{
	SpanObject *s = (SpanObject *)obj;

	(void)closure;
	if (!s->device) {
		PyErr_SetString(PyExc_AttributeError, "span: host memory has no "
				"__cuda_array_interface__ (numpy.asarray views it)");
		return NULL;
	}
	if (!s->owner->client)
		return raise_code(EMBD_EINVAL, "client: closed, its device outputs are gone");
	return Py_BuildValue("{s:(nn),s:s,s:(Ki),s:O,s:i,s:O}", "shape", s->shape[0], s->shape[1],
			     "typestr", "<f4", "data", (unsigned long long)(uintptr_t)s->buf, 0,
			     "strides", Py_None, "version", 3, "stream", Py_None);
}

static PyGetSetDef span_getset[] = {
	{ "__cuda_array_interface__", span_cuda_array_interface, NULL,
	  "Device memory for torch / CuPy / Numba (device outputs in CUDA memory only).", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyBufferProcs span_as_buffer = {
	.bf_getbuffer = span_getbuffer,
	.bf_releasebuffer = span_releasebuffer,
};

static PyTypeObject SpanType = {
	PyVarObject_HEAD_INIT(NULL, 0)
	.tp_name = "embd._client.Span",
	.tp_basicsize = sizeof(SpanObject),
	.tp_dealloc = span_dealloc,
	.tp_as_buffer = &span_as_buffer,
	.tp_getset = span_getset,
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc = "One buffer of a batch slot, for numpy.asarray, or for torch.as_tensor when "
		  "it is CUDA memory (no copy either way).",
};

static PyObject *span_new(ClientObject *owner, void *buf, char format, Py_ssize_t itemsize,
			  Py_ssize_t rows, Py_ssize_t cols, int device)
{
	SpanObject *s = PyObject_New(SpanObject, &SpanType);

	if (!s)
		return NULL;
	Py_INCREF(owner);
	s->owner = owner;
	s->buf = buf;
	s->device = device;
	owner->exports += device;
	s->format[0] = format;
	s->format[1] = 0;
	s->itemsize = itemsize;
	s->ndim = cols < 0 ? 1 : 2;
	s->shape[0] = rows;
	s->shape[1] = cols < 0 ? 0 : cols;
	s->strides[0] = cols < 0 ? itemsize : cols * itemsize;
	s->strides[1] = itemsize;
	return (PyObject *)s;
}

/* ---- Client ------------------------------------------------------------------------------ */

static int client_init(PyObject *obj, PyObject *args, PyObject *kw)
{
	static char *names[] = { "socket_path", "index", "timeout_ms", NULL };
	ClientObject *self = (ClientObject *)obj;
	const char *path;
	int index, timeout_ms, rc;
	char err[1200] = "";
	struct embd_client *c = NULL;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "sii", names, &path, &index, &timeout_ms))
		return -1;
	if (self->client) {
		raise_code(EMBD_EINVAL, "client: already connected");
		return -1;
	}
	Py_BEGIN_ALLOW_THREADS
	rc = embd_connect(path, index, timeout_ms, &c, err, sizeof(err));
	Py_END_ALLOW_THREADS
	if (rc) {
		raise_code(rc, err);
		return -1;
	}
	self->client = c;
	return 0;
}

static PyObject *client_close(PyObject *obj, PyObject *unused)
{
	ClientObject *self = (ClientObject *)obj;

	(void)unused;
	if (!self->client)
		Py_RETURN_NONE;
	if (self->busy)
		return raise_code(EMBD_EBUSY, "close: a call on this client runs in another thread");
	if (self->exports) {
		char msg[200];
		snprintf(msg, sizeof(msg), "close: %zd numpy view(s) of the batch slots (or spans of "
			 "device outputs, which tensors over them keep) are still alive; drop them "
			 "first", self->exports);
		return raise_code(EMBD_EBUSY, msg);
	}
	embd_close(self->client);
	self->client = NULL;
	Py_RETURN_NONE;
}

static void client_dealloc(PyObject *obj)
{
	ClientObject *self = (ClientObject *)obj;

	/* spans hold references, so no export can be alive here */
	embd_close(self->client);
	Py_TYPE(obj)->tp_free(obj);
}

static PyObject *client_layout(PyObject *obj, PyObject *unused)
{
	ClientObject *self = (ClientObject *)obj;

	(void)unused;
	if (!self->client)
		return raise_code(EMBD_EINVAL, "client: closed");
	const struct embd_client_layout *l = embd_layout(self->client);
	PyObject *tables = PyList_New(l->num_tables), *features = PyList_New(l->num_features);
	if (!tables || !features)
		goto fail;
	for (uint32_t i = 0; i < l->num_tables; i++) {
		const struct embd_client_table *t = &l->tables[i];
		PyObject *item = Py_BuildValue("(sLiii)", t->name, (long long)t->num_embeddings,
					       (int)t->embedding_dim, (int)t->pooling,
					       (int)l->table_data_types[i]);
		if (!item)
			goto fail;
		PyList_SET_ITEM(tables, i, item);
	}
	for (uint32_t i = 0; i < l->num_features; i++) {
		const struct embd_client_feature *f = &l->features[i];
		PyObject *item = Py_BuildValue("(sIII)", f->name, f->table, f->dim, f->offset);
		if (!item)
			goto fail;
		PyList_SET_ITEM(features, i, item);
	}
	return Py_BuildValue("{s:i,s:I,s:I,s:I,s:K,s:K,s:N,s:N}", "index", (int)l->index,
			     "trainers_per_node", l->trainers_per_node, "batch_size", l->batch_size,
			     "total_dim", l->total_dim, "max_values",
			     (unsigned long long)l->max_values, "resumed_step",
			     (unsigned long long)l->resumed_step, "tables", tables, "features",
			     features);
fail:
	Py_XDECREF(tables);
	Py_XDECREF(features);
	return NULL;
}

static PyObject *client_resumed_step(PyObject *obj, void *closure)
{
	ClientObject *self = (ClientObject *)obj;

	(void)closure;
	if (!self->client)
		return raise_code(EMBD_EINVAL, "client: closed");
	return PyLong_FromUnsignedLongLong(embd_layout(self->client)->resumed_step);
}

static PyObject *client_closed(PyObject *obj, void *closure)
{
	(void)closure;
	return PyBool_FromLong(((ClientObject *)obj)->client == NULL);
}

/* span(slot, name): "lengths" (F, B) int32, "values" / "weights" (max_values,) int64 /
 * float32, "pooled" / "grad" (B, total_dim) float32. */
static PyObject *client_span(PyObject *obj, PyObject *args)
{
	ClientObject *self = (ClientObject *)obj;
	unsigned int slot;
	const char *name;
	struct embd_batch b;

	if (!PyArg_ParseTuple(args, "Is", &slot, &name))
		return NULL;
	if (!self->client)
		return raise_code(EMBD_EINVAL, "client: closed");
	int rc = embd_batch_get(self->client, slot, &b);
	if (rc)
		return raise_client(self, rc);
	const struct embd_client_layout *l = embd_layout(self->client);
	Py_ssize_t B = l->batch_size, F = l->num_features, D = l->total_dim;
	Py_ssize_t V = (Py_ssize_t)l->max_values;
	if (!strcmp(name, "lengths"))
		return span_new(self, b.lengths, 'i', sizeof(int32_t), F, B, 0);
	if (!strcmp(name, "values"))
		return span_new(self, b.values, 'q', sizeof(int64_t), V, -1, 0);
	if (!strcmp(name, "weights"))
		return span_new(self, b.weights, 'f', sizeof(float), V, -1, 0);
	if (!strcmp(name, "pooled"))
		return span_new(self, b.pooled, 'f', sizeof(float), B, D, self->device_memory);
	if (!strcmp(name, "grad"))
		return span_new(self, b.grad, 'f', sizeof(float), B, D, self->device_memory);
	PyErr_Format(PyExc_ValueError, "span: %s is not lengths, values, weights, pooled or grad",
		     name);
	return NULL;
}

static int abandoned(const ClientObject *self, uint64_t user_data)
{
	return (user_data & BLOCKING_TAG) && user_data <= self->abandoned_through;
}

/*
 * Waits for the next completion that nobody gave up on, in slices of WAIT_SLICE_MS with the
 * GIL released, looking at Python's signals between slices. 0, or -1 with the error set.
 * The caller has set self->busy.
 */
static int wait_one(ClientObject *self, struct embd_completion *out, int timeout_ms)
{
	int waited_ms = 0, rc;

	for (;;) {
		int slice = timeout_ms < 0 || timeout_ms - waited_ms > WAIT_SLICE_MS ?
			    WAIT_SLICE_MS : timeout_ms - waited_ms;
		Py_BEGIN_ALLOW_THREADS
		rc = embd_wait(self->client, out, slice);
		Py_END_ALLOW_THREADS
		if (rc == 0) {
			if (abandoned(self, out->user_data))
				continue;
			return 0;
		}
		if (rc != EMBD_ETIMEDOUT) {
			raise_client(self, rc);
			return -1;
		}
		waited_ms += slice;
		if (PyErr_CheckSignals())
			return -1;
		if (timeout_ms >= 0 && waited_ms >= timeout_ms) {
			char msg[80];
			snprintf(msg, sizeof(msg), "wait: no completion within %d ms", timeout_ms);
			raise_code(EMBD_ETIMEDOUT, msg);
			return -1;
		}
	}
}

/*
 * forward / backward / eval: submit, then wait for that completion (timeout_ms < 0: no
 * limit). batch_size 0 is the layout's; an eval's step is ignored.
 */
static PyObject *blocking(ClientObject *self, enum embd_request_op op, PyObject *args,
			  PyObject *kw)
{
	static char *names[] = { "slot", "step", "num_values", "weighted", "timeout_ms",
				 "batch_size", NULL };
	unsigned int slot, batch_size = 0;
	unsigned long long step, num_values;
	int weighted = 0, timeout_ms = -1;
	struct embd_completion done;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "IKK|piI", names, &slot, &step, &num_values,
					 &weighted, &timeout_ms, &batch_size))
		return NULL;
	if (usable(self))
		return NULL;
	struct embd_request req = { .op = op, .slot = slot, .step = step,
				    .num_values = num_values, .weighted = weighted,
				    .user_data = BLOCKING_TAG | ++self->next_user_data,
				    .batch_size = batch_size };
	int rc = embd_submit(self->client, &req);
	if (rc)
		return raise_client(self, rc);
	self->busy = 1;
	rc = wait_one(self, &done, timeout_ms);
	self->busy = 0;
	if (rc) {
		self->abandoned_through = req.user_data;
		return NULL;
	}
	if (done.user_data != req.user_data)
		return raise_code(EMBD_EPROTO, "completion of another request while waiting for a "
				  "blocking one: do not mix submit() with forward()/backward()");
	if (done.result)
		return raise_step(done.result, embd_last_error(self->client), (long long)done.step);
	Py_RETURN_NONE;
}

static PyObject *client_forward(PyObject *obj, PyObject *args, PyObject *kw)
{
	return blocking((ClientObject *)obj, EMBD_REQUEST_FORWARD, args, kw);
}

static PyObject *client_backward(PyObject *obj, PyObject *args, PyObject *kw)
{
	return blocking((ClientObject *)obj, EMBD_REQUEST_BACKWARD, args, kw);
}

static PyObject *client_eval(PyObject *obj, PyObject *args, PyObject *kw)
{
	return blocking((ClientObject *)obj, EMBD_REQUEST_EVAL, args, kw);
}

static PyObject *client_submit(PyObject *obj, PyObject *args, PyObject *kw)
{
	static char *names[] = { "op", "slot", "step", "num_values", "weighted", "user_data",
				 "batch_size", NULL };
	ClientObject *self = (ClientObject *)obj;
	int op, weighted = 0;
	unsigned int slot = 0, batch_size = 0;
	unsigned long long step = 0, num_values = 0, user_data = 0;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "i|IKKpKI", names, &op, &slot, &step,
					 &num_values, &weighted, &user_data, &batch_size))
		return NULL;
	if (usable(self))
		return NULL;
	if (user_data & BLOCKING_TAG)
		return raise_code(EMBD_EINVAL, "submit: user_data must be below 2**63");
	struct embd_request req = { .op = (enum embd_request_op)op, .slot = slot, .step = step,
				    .num_values = num_values, .weighted = weighted,
				    .user_data = user_data, .batch_size = batch_size };
	int rc = embd_submit(self->client, &req);
	if (rc)
		return raise_client(self, rc);
	Py_RETURN_NONE;
}

static PyObject *completion_tuple(ClientObject *self, const struct embd_completion *done)
{
	return Py_BuildValue("(KKis)", (unsigned long long)done->user_data,
			     (unsigned long long)done->step, done->result,
			     done->result ? embd_last_error(self->client) : "");
}

static PyObject *client_poll(PyObject *obj, PyObject *unused)
{
	ClientObject *self = (ClientObject *)obj;
	struct embd_completion done;

	(void)unused;
	if (usable(self))
		return NULL;
	for (;;) {
		int rc = embd_poll(self->client, &done);
		if (rc == EMBD_EAGAIN)
			Py_RETURN_NONE;
		if (rc)
			return raise_client(self, rc);
		if (!abandoned(self, done.user_data))
			return completion_tuple(self, &done);
	}
}

static PyObject *client_wait(PyObject *obj, PyObject *args, PyObject *kw)
{
	static char *names[] = { "timeout_ms", NULL };
	ClientObject *self = (ClientObject *)obj;
	struct embd_completion done;
	int timeout_ms = -1;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "|i", names, &timeout_ms))
		return NULL;
	if (usable(self))
		return NULL;
	self->busy = 1;
	int rc = wait_one(self, &done, timeout_ms);
	self->busy = 0;
	return rc ? NULL : completion_tuple(self, &done);
}

/* ---- live table access ------------------------------------------------------------------- */

/* table_info(table, array) -> (num_embeddings, cols, max_rows, applied_step, optimizer_step) */
static PyObject *client_table_info(PyObject *obj, PyObject *args)
{
	ClientObject *self = (ClientObject *)obj;
	unsigned int table, array;
	struct embd_table_info info;
	int rc;

	if (!PyArg_ParseTuple(args, "II", &table, &array))
		return NULL;
	if (usable(self))
		return NULL;
	self->busy = 1;
	Py_BEGIN_ALLOW_THREADS
	rc = embd_table_info(self->client, table, (enum embd_table_array)array, &info);
	Py_END_ALLOW_THREADS
	self->busy = 0;
	if (rc)
		return raise_client(self, rc);
	return Py_BuildValue("(LIIKL)", (long long)info.num_embeddings, info.cols, info.max_rows,
			     (unsigned long long)info.applied_step, (long long)info.optimizer_step);
}

/* 0 when view (of what) holds C-contiguous items of itemsize bytes; else -1, error set. */
static int check_items(const Py_buffer *view, Py_ssize_t itemsize, const char *what)
{
	if (view->itemsize == itemsize && view->len % itemsize == 0)
		return 0;
	PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, expected %zd", what,
		     view->itemsize, itemsize);
	return -1;
}

/*
 * table_read(table, array, out, row_begin, ids) / table_write(table, array, rows, row_begin,
 * ids): the rows travel through a C-contiguous float32 buffer of n x cols floats, n rows from
 * row_begin, or the n rows ids (an int64 buffer, or None). libembdclient splits them into
 * chunks. A read returns the step its rows hold.
 */
static PyObject *table_io(ClientObject *self, PyObject *args, int write)
{
	unsigned int table, array;
	long long row_begin;
	PyObject *data, *ids_obj;
	Py_buffer rows = { 0 }, ids = { 0 };
	struct embd_table_info info;
	uint64_t applied = 0;
	PyObject *ret = NULL;
	int rc;

	if (!PyArg_ParseTuple(args, "IIOLO", &table, &array, &data, &row_begin, &ids_obj))
		return NULL;
	if (usable(self))
		return NULL;
	int flags = PyBUF_C_CONTIGUOUS | (write ? 0 : PyBUF_WRITABLE);
	if (PyObject_GetBuffer(data, &rows, flags) || check_items(&rows, 4, "rows"))
		goto out;
	if (ids_obj != Py_None &&
	    (PyObject_GetBuffer(ids_obj, &ids, PyBUF_C_CONTIGUOUS) || check_items(&ids, 8, "ids")))
		goto out;
	self->busy = 1;
	Py_BEGIN_ALLOW_THREADS
	rc = embd_table_info(self->client, table, (enum embd_table_array)array, &info);
	Py_END_ALLOW_THREADS
	self->busy = 0;
	if (rc) {
		raise_client(self, rc);
		goto out;
	}
	const uint64_t n = (uint64_t)rows.len / 4 / info.cols;
	if ((uint64_t)rows.len != n * info.cols * 4 || (ids.obj && (uint64_t)ids.len / 8 != n)) {
		char msg[200];
		snprintf(msg, sizeof(msg), "table %u: %zd floats for rows of %u%s%zd ids", table,
			 rows.len / 4, info.cols, ids.obj ? ", " : "", ids.obj ? ids.len / 8 : 0);
		raise_code(EMBD_EINVAL, msg);
		goto out;
	}
	const enum embd_table_array a = (enum embd_table_array)array;
	self->busy = 1;
	Py_BEGIN_ALLOW_THREADS
	if (write)
		rc = ids.obj ? embd_table_write_ids(self->client, table, a, ids.buf, n, rows.buf)
			     : embd_table_write(self->client, table, a, row_begin, n, rows.buf);
	else
		rc = ids.obj ? embd_table_read_ids(self->client, table, a, ids.buf, n, rows.buf,
						   &applied)
			     : embd_table_read(self->client, table, a, row_begin, n, rows.buf,
					       &applied);
	Py_END_ALLOW_THREADS
	self->busy = 0;
	if (rc)
		raise_client(self, rc);
	else
		ret = PyLong_FromUnsignedLongLong(applied);
out:
	if (rows.obj)
		PyBuffer_Release(&rows);
	if (ids.obj)
		PyBuffer_Release(&ids);
	return ret;
}

/* device_outputs(cuda_device): (on_device, buffer_bytes); from then on span() hands out the
 * device buffers as pooled and grad. */
static PyObject *client_device_outputs(PyObject *obj, PyObject *args)
{
	ClientObject *self = (ClientObject *)obj;
	struct embd_device_outputs out;
	int cuda_device, rc;

	if (!PyArg_ParseTuple(args, "i", &cuda_device) || usable(self))
		return NULL;
	self->busy = 1;
	Py_BEGIN_ALLOW_THREADS
	rc = embd_device_outputs(self->client, cuda_device, &out);
	Py_END_ALLOW_THREADS
	self->busy = 0;
	if (rc)
		return raise_client(self, rc);
	self->device_memory = out.on_device;
	return Py_BuildValue("(iK)", out.on_device, (unsigned long long)out.buffer_bytes);
}

static PyObject *client_table_read(PyObject *obj, PyObject *args)
{
	return table_io((ClientObject *)obj, args, 0);
}

static PyObject *client_table_write(PyObject *obj, PyObject *args)
{
	return table_io((ClientObject *)obj, args, 1);
}

static PyMethodDef client_methods[] = {
	{ "close", client_close, METH_NOARGS, "Disconnects; refused while slot views live." },
	{ "layout", client_layout, METH_NOARGS, "The layout from WELCOME, as a dict." },
	{ "span", client_span, METH_VARARGS, "span(slot, name): one buffer of a batch slot." },
	{ "forward", (PyCFunction)(void (*)(void))client_forward, METH_VARARGS | METH_KEYWORDS,
	  "forward(slot, step, num_values, weighted=False, timeout_ms=-1, batch_size=0)" },
	{ "backward", (PyCFunction)(void (*)(void))client_backward, METH_VARARGS | METH_KEYWORDS,
	  "backward(slot, step, num_values, weighted=False, timeout_ms=-1, batch_size=0)" },
	{ "eval", (PyCFunction)(void (*)(void))client_eval, METH_VARARGS | METH_KEYWORDS,
	  "eval(slot, step, num_values, weighted=False, timeout_ms=-1, batch_size=0)" },
	{ "table_info", client_table_info, METH_VARARGS, "table_info(table, array): a tuple." },
	{ "table_read", client_table_read, METH_VARARGS,
	  "table_read(table, array, out, row_begin, ids): the step the rows hold." },
	{ "table_write", client_table_write, METH_VARARGS,
	  "table_write(table, array, rows, row_begin, ids)" },
	{ "submit", (PyCFunction)(void (*)(void))client_submit, METH_VARARGS | METH_KEYWORDS,
	  "submit(op, slot=0, step=0, num_values=0, weighted=False, user_data=0, batch_size=0)" },
	{ "device_outputs", client_device_outputs, METH_VARARGS,
	  "device_outputs(cuda_device): (on_device, buffer_bytes)" },
	{ "poll", client_poll, METH_NOARGS, "The oldest completion tuple, or None." },
	{ "wait", (PyCFunction)(void (*)(void))client_wait, METH_VARARGS | METH_KEYWORDS,
	  "wait(timeout_ms=-1): the oldest completion tuple." },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef client_getset[] = {
	{ "resumed_step", client_resumed_step, NULL, "The step to post next after a resume.",
	  NULL },
	{ "closed", client_closed, NULL, "Whether close() ran.", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyTypeObject ClientType = {
	PyVarObject_HEAD_INIT(NULL, 0)
	.tp_name = "embd._client.Client",
	.tp_basicsize = sizeof(ClientObject),
	.tp_dealloc = client_dealloc,
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc = "Client(socket_path, index, timeout_ms): one libembdclient handle.",
	.tp_methods = client_methods,
	.tp_getset = client_getset,
	.tp_init = client_init,
	.tp_new = PyType_GenericNew,
};

/* ---- the module ---------------------------------------------------------------------------- */

static PyObject *mod_strerror(PyObject *mod, PyObject *arg)
{
	(void)mod;
	long code = PyLong_AsLong(arg);
	if (code == -1 && PyErr_Occurred())
		return NULL;
	return PyUnicode_FromString(embd_strerror((int)code));
}

static PyMethodDef module_methods[] = {
	{ "strerror", mod_strerror, METH_O, "The short description of an EMBD_E* code." },
	{ NULL, NULL, 0, NULL },
};

static struct PyModuleDef module_def = {
	PyModuleDef_HEAD_INIT, .m_name = "embd._client",
	.m_doc = "libembdclient for Python (use the embd package, not this module).",
	.m_size = -1, .m_methods = module_methods,
};

/* The codes of embd/types.h by name, so Python never restates their values. */
static const struct { const char *name; int code; } codes[] = {
	{ "EMBD_OK", EMBD_OK }, { "EMBD_EINVAL", EMBD_EINVAL }, { "EMBD_ENOMEM", EMBD_ENOMEM },
	{ "EMBD_ERANGE", EMBD_ERANGE }, { "EMBD_ENOENT", EMBD_ENOENT }, { "EMBD_EIO", EMBD_EIO },
	{ "EMBD_EACCES", EMBD_EACCES }, { "EMBD_ETIMEDOUT", EMBD_ETIMEDOUT },
	{ "EMBD_EPROTO", EMBD_EPROTO }, { "EMBD_ECONNRESET", EMBD_ECONNRESET },
	{ "EMBD_ENOSPC", EMBD_ENOSPC }, { "EMBD_EBUSY", EMBD_EBUSY }, { "EMBD_EAGAIN", EMBD_EAGAIN },
	{ "EMBD_ECANCELED", EMBD_ECANCELED }, { "EMBD_ENOTSUP", EMBD_ENOTSUP },
	{ "EMBD_EPARSE", EMBD_EPARSE }, { "EMBD_EMISMATCH", EMBD_EMISMATCH },
	{ "EMBD_EINFEASIBLE", EMBD_EINFEASIBLE }, { "EMBD_ECHECKSUM", EMBD_ECHECKSUM },
	{ "EMBD_ERESUMED", EMBD_ERESUMED },
};

static int add_constants(PyObject *m)
{
	PyObject *d = PyDict_New();

	if (!d)
		return -1;
	for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++) {
		PyObject *v = PyLong_FromLong(codes[i].code);
		if (!v || PyDict_SetItemString(d, codes[i].name, v)) {
			Py_XDECREF(v);
			Py_DECREF(d);
			return -1;
		}
		Py_DECREF(v);
	}
	if (PyModule_AddObject(m, "codes", d)) {
		Py_DECREF(d);
		return -1;
	}
	if (PyModule_AddIntConstant(m, "SLOTS", EMBD_CLIENT_SLOTS) ||
	    PyModule_AddIntConstant(m, "ANY_INDEX", EMBD_CLIENT_ANY_INDEX) ||
	    PyModule_AddIntConstant(m, "NAME_MAX", EMBD_NAME_MAX) ||
	    PyModule_AddIntConstant(m, "OP_NOP", EMBD_REQUEST_NOP) ||
	    PyModule_AddIntConstant(m, "OP_FORWARD", EMBD_REQUEST_FORWARD) ||
	    PyModule_AddIntConstant(m, "OP_BACKWARD", EMBD_REQUEST_BACKWARD) ||
	    PyModule_AddIntConstant(m, "OP_EVAL", EMBD_REQUEST_EVAL) ||
	    PyModule_AddIntConstant(m, "TABLE_WEIGHTS", EMBD_TABLE_WEIGHTS) ||
	    PyModule_AddIntConstant(m, "TABLE_MOMENTUM1", EMBD_TABLE_MOMENTUM1) ||
	    PyModule_AddIntConstant(m, "TABLE_MOMENTUM2", EMBD_TABLE_MOMENTUM2) ||
	    PyModule_AddIntConstant(m, "DTYPE_FP32", EMBD_DTYPE_FP32) ||
	    PyModule_AddIntConstant(m, "DTYPE_FP16", EMBD_DTYPE_FP16) ||
	    PyModule_AddIntConstant(m, "POOLING_SUM", EMBD_POOLING_SUM) ||
	    PyModule_AddIntConstant(m, "POOLING_MEAN", EMBD_POOLING_MEAN))
		return -1;
	return 0;
}

PyMODINIT_FUNC PyInit__client(void)
{
	if (PyType_Ready(&ClientType) || PyType_Ready(&SpanType))
		return NULL;
	PyObject *m = PyModule_Create(&module_def);
	if (!m)
		return NULL;
	Py_INCREF(&ClientType);
	if (PyModule_AddObject(m, "Client", (PyObject *)&ClientType)) {
		Py_DECREF(&ClientType);
		goto fail;
	}
	Py_INCREF(&SpanType);
	if (PyModule_AddObject(m, "Span", (PyObject *)&SpanType)) {
		Py_DECREF(&SpanType);
		goto fail;
	}
	if (add_constants(m))
		goto fail;
	return m;
fail:
	Py_DECREF(m);
	return NULL;
}
