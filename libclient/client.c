/*
 * libembdclient (include/embd/client.h): the trainer's side of the control socket and the
 * shared region.
 *
 * The one idea: the slab is carved once, at connect, into EMBD_CLIENT_SLOTS fixed batch
 * slots (lengths, values, weights, pooled, grad, each 64-byte aligned), so a request is just
 * a slot number turned into an SQE of slab spans; the service checks every span anyway.
 * Waiting is bounded spinning, then a futex sleep on the CQ doorbell in 100 ms slices so a
 * dead service is noticed (socket hangup) instead of sleeping forever. Device outputs
 * (libclient/device.h) only swap the slots' pooled and grad spans for spans of the GPU buffers.
 */
#include "embd/client.h"

#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ipc/control.h"
#include "ipc/doorbell.h"
#include "ipc/protocol.h"
#include "ipc/region.h"
#include "libclient/client_internal.h"
#include "libclient/device.h"

/* Looks at the completion ring before sleeping: ~0.1 ms with pause on x86, far more than
 * any IPC round trip, far less than a step. Spinning longer (20000 was ~1 ms) only takes the
 * CPU from the service's workers when the trainer shares CPUs with them: embd-bench e2e at
 * 64K ids went 0.83 -> 0.90 on a 2-CPU VM. */
#define SPIN_ITERS 2000u
#define SLEEP_SLICE_MS 100
#define SPAN_ALIGN 64u

struct slot_spans {
	struct embd_slab_span lengths, values, weights, pooled, grad;
};

struct embd_client {
	int sock;
	struct embd_region *region;
	int eventfd;
	struct embd_doorbell sq_db, cq_db;
	struct embd_client_layout layout;
	struct embd_client_table *tables;
	enum embd_data_type *table_data_types;
	struct embd_client_feature *features;
	struct slot_spans slots[EMBD_CLIENT_SLOTS];
	uint64_t next_user_data;
	uint8_t *table_buf;             /* one control message, for table access and device
					 * outputs (lazily) */
	/* device outputs: non-NULL once granted; then every batch's pooled and grad are there */
	struct client_device *device;
	struct embd_device_outputs device_out;
	struct embd_ctl_device_outputs device_spans;    /* the service's offsets */
	char last_error[EMBD_CTL_TEXT_MAX + 64];
};

__attribute__((format(printf, 3, 4)))
static int fail(struct embd_client *c, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
	va_end(ap);
	return code;
}

static uint64_t align_up(uint64_t x, uint64_t a)
{
	return (x + a - 1) / a * a;
}

static struct embd_slab_span take(uint64_t *cursor, uint64_t bytes)
{
	struct embd_slab_span s = { align_up(*cursor, SPAN_ALIGN), bytes };

	*cursor = s.offset + bytes;
	return s;
}

/* Carves the slab into the batch slots; EMBD_ENOSPC when the service's slab is too small. */
static int carve_slots(struct embd_client *c)
{
	const struct embd_client_layout *l = &c->layout;
	uint64_t out_bytes = (uint64_t)l->batch_size * l->total_dim * sizeof(float), cursor = 0;

	for (uint32_t i = 0; i < EMBD_CLIENT_SLOTS; i++) {
		struct slot_spans *s = &c->slots[i];
		s->lengths = take(&cursor, (uint64_t)l->num_features * l->batch_size * sizeof(int32_t));
		s->values = take(&cursor, l->max_values * sizeof(int64_t));
		s->weights = take(&cursor, l->max_values * sizeof(float));
		s->pooled = take(&cursor, out_bytes);
		s->grad = take(&cursor, out_bytes);
	}
	if (cursor > embd_region_slab_bytes(c->region))
		return fail(c, EMBD_ENOSPC, "region: slab of %llu bytes, batch slots need %llu",
			    (unsigned long long)embd_region_slab_bytes(c->region),
			    (unsigned long long)cursor);
	return 0;
}

static int take_layout(struct embd_client *c, const struct embd_layout *w)
{
	const struct embd_layout_fixed *f = &w->fixed;

	c->tables = calloc(f->num_tables ? f->num_tables : 1, sizeof(*c->tables));
	c->features = calloc(f->num_features ? f->num_features : 1, sizeof(*c->features));
	c->table_data_types = calloc(f->num_tables ? f->num_tables : 1,
				     sizeof(*c->table_data_types));
	if (!c->tables || !c->features || !c->table_data_types)
		return fail(c, EMBD_ENOMEM, "layout: out of memory");
	for (uint32_t i = 0; i < f->num_tables; i++) {
		memcpy(c->tables[i].name, w->tables[i].name, EMBD_NAME_MAX);
		c->tables[i].num_embeddings = w->tables[i].num_embeddings;
		c->tables[i].embedding_dim = w->tables[i].embedding_dim;
		c->tables[i].pooling = (enum embd_pooling)w->tables[i].pooling;
		c->table_data_types[i] = (enum embd_data_type)w->tables[i].data_type;
	}
	for (uint32_t i = 0; i < f->num_features; i++) {
		memcpy(c->features[i].name, w->features[i].name, EMBD_NAME_MAX);
		c->features[i].table = w->features[i].table;
		c->features[i].dim = w->features[i].dim;
		c->features[i].offset = w->features[i].offset;
	}
	c->layout = (struct embd_client_layout){
		.index = f->rank, .trainers_per_node = f->local_world_size,
		.batch_size = f->batch_size, .total_dim = f->total_dim, .max_values = f->max_values,
		.resumed_step = f->resumed_step, .num_tables = f->num_tables,
		.num_features = f->num_features, .tables = c->tables, .features = c->features,
		.table_data_types = c->table_data_types,
	};
	return 0;
}

/* Sends HELLO and takes WELCOME (or the service's ERROR) with its fds. */
static int handshake(struct embd_client *c, int wanted_index, int timeout_ms)
{
	struct embd_ctl_hello hello = { .protocol_version = EMBD_CTL_VERSION,
					.wanted_rank = wanted_index, .pid = (int32_t)getpid() };
	uint8_t payload[sizeof(hello)];
	struct embd_layout *w = NULL;
	struct embd_ctl_msg msg = { .nfds = 0 };
	uint8_t *buf = malloc(EMBD_CTL_MSG_MAX);
	char *e = c->last_error;
	size_t el = sizeof(c->last_error);
	int rc, code;

	w = calloc(1, sizeof(*w));
	rc = fail(c, EMBD_ENOMEM, "connect: out of memory");
	if (!buf || !w)
		goto out;
	embd_ctl_hello_encode(&hello, payload);
	rc = embd_ctl_send(c->sock, EMBD_CTL_HELLO, payload, sizeof(payload), NULL, 0, e, el);
	/* a service that refuses us may have shut the socket before HELLO got there: its
	 * ERROR is queued all the same */
	if (rc && rc != EMBD_ECONNRESET)
		goto out;
	rc = embd_ctl_recv(c->sock, buf, EMBD_CTL_MSG_MAX, rc ? 0 : timeout_ms, &msg, e, el);
	if (rc)
		goto out;
	if (msg.type == EMBD_CTL_ERROR) {
		char text[EMBD_CTL_TEXT_MAX + 1];
		rc = embd_ctl_error_decode(&msg, &code, text, sizeof(text), e, el);
		if (!rc)
			rc = fail(c, code < 0 ? code : EMBD_EPROTO, "service refused: %s", text);
		goto out;
	}
	rc = fail(c, EMBD_EPROTO, "connect: expected WELCOME, got message type %u", msg.type);
	if (msg.type != EMBD_CTL_WELCOME || msg.nfds < 1)
		goto out;
	rc = embd_ctl_welcome_decode(&msg, w, e, el);
	if (rc)
		goto out;
	rc = fail(c, EMBD_EPROTO, "WELCOME flags: eventfd announced but %u fds came", msg.nfds);
	if (!!(w->fixed.flags & EMBD_LAYOUT_EVENTFD) != (msg.nfds == 2))
		goto out;
	rc = embd_region_attach(&c->region, msg.fds[0], e, el);
	if (rc)
		goto out;
	msg.fds[0] = -1;
	if (msg.nfds == 2) {
		c->eventfd = msg.fds[1];
		msg.fds[1] = -1;
	}
	msg.nfds = 0;
	rc = take_layout(c, w);
	if (!rc)
		rc = carve_slots(c);
out:
	for (unsigned i = 0; i < msg.nfds; i++)
		if (msg.fds[i] >= 0)
			close(msg.fds[i]);
	free(w);
	free(buf);
	return rc;
}

int embd_connect(const char *socket_path, int wanted_index, int timeout_ms,
		 struct embd_client **out, char *err, size_t err_len)
{
	struct embd_client *c = calloc(1, sizeof(*c));
	int rc = EMBD_ENOMEM;

	*out = NULL;
	if (!c)
		goto out;
	c->sock = -1;
	c->eventfd = -1;
	rc = embd_ctl_connect(socket_path, &c->sock, c->last_error, sizeof(c->last_error));
	if (rc)
		goto out;
	rc = handshake(c, wanted_index, timeout_ms);
	if (rc)
		goto out;
	embd_doorbell_init(&c->sq_db, embd_region_sq(c->region), c->eventfd);
	embd_doorbell_init(&c->cq_db, embd_region_cq(c->region), -1);
	c->last_error[0] = 0;
	*out = c;
	return 0;
out:
	if (err && err_len)
		snprintf(err, err_len, "%s", c ? c->last_error : "connect: out of memory");
	embd_close(c);
	return rc;
}

void embd_close(struct embd_client *c)
{
	if (!c)
		return;
	client_device_unmap(c->device);
	embd_region_destroy(c->region);
	if (c->eventfd >= 0)
		close(c->eventfd);
	if (c->sock >= 0)
		close(c->sock);
	free(c->tables);
	free(c->table_data_types);
	free(c->features);
	free(c->table_buf);
	free(c);
}

const struct embd_client_layout *embd_layout(const struct embd_client *c)
{
	return &c->layout;
}

const char *embd_last_error(const struct embd_client *c)
{
	return c->last_error;
}

int embd_batch_get(struct embd_client *c, uint32_t slot, struct embd_batch *out)
{
	if (slot >= EMBD_CLIENT_SLOTS)
		return fail(c, EMBD_EINVAL, "slot: %u, the region has %u", slot, EMBD_CLIENT_SLOTS);
	uint8_t *slab = embd_region_slab(c->region);
	const struct slot_spans *s = &c->slots[slot];
	*out = (struct embd_batch){
		.lengths = (int32_t *)(slab + s->lengths.offset),
		.values = (int64_t *)(slab + s->values.offset),
		.weights = (float *)(slab + s->weights.offset),
		.pooled = c->device ? c->device_out.pooled[slot] : (float *)(slab + s->pooled.offset),
		.grad = c->device ? c->device_out.grad[slot] : (float *)(slab + s->grad.offset),
	};
	return 0;
}

int embd_client_push_sqe(struct embd_client *c, const struct embd_sqe *sqe)
{
	int rc = embd_ring_push(embd_region_sq(c->region), sqe);

	if (rc == EMBD_ENOSPC)
		return fail(c, rc, "submit: submission ring full, wait for completions first");
	if (rc)
		return fail(c, rc, "submit: submission ring is corrupt");
	if (embd_doorbell_notify(embd_region_sq(c->region), &c->sq_db) < 0)
		return fail(c, EMBD_EIO, "submit: cannot ring the service's doorbell");
	return 0;
}

uint64_t embd_client_slab_bytes(const struct embd_client *c)
{
	return embd_region_slab_bytes(c->region);
}

int embd_client_sqe_build(struct embd_client *c, const struct embd_request *req,
			  struct embd_sqe *sqe)
{
	const struct embd_client_layout *l = &c->layout;

	memset(sqe, 0, sizeof(*sqe));
	if (req->op != EMBD_REQUEST_NOP && req->op != EMBD_REQUEST_FORWARD &&
	    req->op != EMBD_REQUEST_BACKWARD && req->op != EMBD_REQUEST_EVAL)
		return fail(c, EMBD_EINVAL, "op: %d is not NOP, FORWARD, BACKWARD or EVAL",
			    (int)req->op);
	sqe->opcode = (uint16_t)req->op;
	sqe->user_data = req->user_data;
	/* an evaluation belongs to no training step */
	sqe->step = req->op == EMBD_REQUEST_EVAL ? 0 : req->step;
	if (req->op == EMBD_REQUEST_NOP)
		return 0;
	if (req->slot >= EMBD_CLIENT_SLOTS)
		return fail(c, EMBD_EINVAL, "slot: %u, the region has %u", req->slot,
			    EMBD_CLIENT_SLOTS);
	if (req->num_values > l->max_values)
		return fail(c, EMBD_EINVAL, "num_values: %llu, at most %llu per batch",
			    (unsigned long long)req->num_values, (unsigned long long)l->max_values);
	const uint32_t b = req->batch_size ? req->batch_size : l->batch_size;
	if (b > l->batch_size)
		return fail(c, EMBD_EINVAL, "batch_size: %u samples, at most %u per batch", b,
			    l->batch_size);
	const struct slot_spans *s = &c->slots[req->slot];
	const uint64_t out_bytes = (uint64_t)b * l->total_dim * sizeof(float);
	sqe->batch_size = b;
	sqe->num_values = req->num_values;
	sqe->lengths = (struct embd_slab_span){ s->lengths.offset,
						(uint64_t)l->num_features * b * sizeof(int32_t) };
	sqe->values = (struct embd_slab_span){ s->values.offset, req->num_values * sizeof(int64_t) };
	if (req->weighted) {
		sqe->flags |= EMBD_SQE_WEIGHTED;
		sqe->weights = (struct embd_slab_span){ s->weights.offset,
							req->num_values * sizeof(float) };
	}
	/* the slot's pooled and grad: in the slab, or at the service's offsets on the GPU */
	const bool device = c->device != NULL;
	if (device)
		sqe->flags |= EMBD_SQE_DEVICE;
	if (req->op == EMBD_REQUEST_FORWARD || req->op == EMBD_REQUEST_EVAL)
		sqe->output = (struct embd_slab_span){
			device ? c->device_spans.pooled[req->slot] : s->pooled.offset, out_bytes };
	else
		sqe->grad = (struct embd_slab_span){
			device ? c->device_spans.grad[req->slot] : s->grad.offset, out_bytes };
	return 0;
}

int embd_submit(struct embd_client *c, const struct embd_request *req)
{
	struct embd_sqe sqe;
	int rc = embd_client_sqe_build(c, req, &sqe);

	return rc ? rc : embd_client_push_sqe(c, &sqe);
}

/* EMBD_ECONNRESET once the service closed the socket (a message would be a protocol error:
 * nothing is sent to a trainer after WELCOME). */
static int check_socket(struct embd_client *c)
{
	struct pollfd p = { .fd = c->sock, .events = POLLIN };

	if (poll(&p, 1, 0) <= 0)
		return 0;
	if (p.revents & (POLLHUP | POLLERR))
		return fail(c, EMBD_ECONNRESET, "the service closed the connection");
	return fail(c, EMBD_EPROTO, "unexpected message from the service on the control socket");
}

int embd_poll(struct embd_client *c, struct embd_completion *out)
{
	struct embd_cqe cqe;
	int rc = embd_ring_pop(embd_region_cq(c->region), &cqe);

	if (rc == EMBD_EAGAIN) {
		int sock = check_socket(c);
		return sock ? sock : EMBD_EAGAIN;
	}
	if (rc)
		return fail(c, rc, "completion ring is corrupt");
	*out = (struct embd_completion){ cqe.user_data, cqe.step, cqe.result };
	/* the cluster re-formed at another step (dist/regroup.h): that step is the next */
	if (cqe.result == EMBD_ERESUMED)
		c->layout.resumed_step = cqe.step;
	if (cqe.result) {
		cqe.message[EMBD_CQE_MSG_BYTES - 1] = 0;
		fail(c, cqe.result, "step %llu: %s", (unsigned long long)cqe.step,
		     cqe.message[0] ? cqe.message : embd_strerror(cqe.result));
	}
	return 0;
}

int embd_wait(struct embd_client *c, struct embd_completion *out, int timeout_ms)
{
	struct embd_ring *cq = embd_region_cq(c->region);
	int waited_ms = 0;

	for (;;) {
		int slice = timeout_ms < 0 || timeout_ms - waited_ms > SLEEP_SLICE_MS ?
			    SLEEP_SLICE_MS : timeout_ms - waited_ms;
		int rc = embd_doorbell_wait(cq, &c->cq_db, SPIN_ITERS, slice);
		if (rc == 0)
			return embd_poll(c, out);
		if (rc != EMBD_ETIMEDOUT)
			return fail(c, rc, "wait: cannot sleep on the completion doorbell");
		rc = check_socket(c);
		if (rc)
			return rc;
		waited_ms += slice;
		if (timeout_ms >= 0 && waited_ms >= timeout_ms)
			return fail(c, EMBD_ETIMEDOUT, "wait: no completion within %d ms", timeout_ms);
	}
}

int embd_run(struct embd_client *c, const struct embd_request *req)
{
	struct embd_request r = *req;
	struct embd_completion done;

	r.user_data = ++c->next_user_data;
	int rc = embd_submit(c, &r);
	if (rc)
		return rc;
	rc = embd_wait(c, &done, -1);
	if (rc)
		return rc;
	if (done.user_data != r.user_data)
		return fail(c, EMBD_EPROTO, "completion for request %llu while waiting for %llu",
			    (unsigned long long)done.user_data, (unsigned long long)r.user_data);
	return done.result;
}

int embd_forward(struct embd_client *c, uint32_t slot, uint64_t step, uint64_t num_values,
		 int weighted)
{
	struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .slot = slot, .step = step,
				    .num_values = num_values, .weighted = weighted };
	return embd_run(c, &req);
}

int embd_backward(struct embd_client *c, uint32_t slot, uint64_t step, uint64_t num_values,
		  int weighted)
{
	struct embd_request req = { .op = EMBD_REQUEST_BACKWARD, .slot = slot, .step = step,
				    .num_values = num_values, .weighted = weighted };
	return embd_run(c, &req);
}

int embd_eval(struct embd_client *c, uint32_t slot, uint32_t batch_size, uint64_t num_values,
	      int weighted)
{
	struct embd_request req = { .op = EMBD_REQUEST_EVAL, .slot = slot, .batch_size = batch_size,
				    .num_values = num_values, .weighted = weighted };
	return embd_run(c, &req);
}

/*
 * One request on the control socket (payload may lie in c->table_buf: it is sent before the
 * answer overwrites it) and its answer into c->table_buf; the service's ERROR comes back as its
 * code, its text after `what`.
 */
static int control_call(struct embd_client *c, enum embd_ctl_type type, const void *payload,
			uint32_t len, const char *what, struct embd_ctl_msg *msg)
{
	char *e = c->last_error;
	const size_t el = sizeof(c->last_error);
	int rc, code;

	if (!c->table_buf && !(c->table_buf = malloc(EMBD_CTL_MSG_MAX)))
		return fail(c, EMBD_ENOMEM, "%s: out of memory", what);
	if ((rc = embd_ctl_send(c->sock, type, payload, len, NULL, 0, e, el)) ||
	    (rc = embd_ctl_recv(c->sock, c->table_buf, EMBD_CTL_MSG_MAX, -1, msg, e, el)))
		return rc;
	if (msg->type != EMBD_CTL_ERROR)
		return 0;
	char text[EMBD_CTL_TEXT_MAX + 1];
	rc = embd_ctl_error_decode(msg, &code, text, sizeof(text), e, el);
	return rc ? rc : fail(c, code < 0 ? code : EMBD_EPROTO, "%s: %s", what, text);
}

/* ---- device outputs ------------------------------------------------------------------------ */

int embd_client_device_outputs_uuid(struct embd_client *c, const uint8_t uuid[16],
				    int cuda_device, struct embd_device_outputs *out)
{
	const struct embd_client_layout *l = &c->layout;
	const uint64_t rows = (uint64_t)l->batch_size * l->total_dim * sizeof(float);
	struct embd_ctl_device_request req = { .flags = 0 };
	struct embd_ctl_device_outputs *rep = &c->device_spans;
	struct embd_ctl_msg msg = { .nfds = 0 };
	uint8_t *base;
	int rc;

	if (c->device)
		return fail(c, EMBD_EBUSY, "device outputs: this handle has them already");
	memcpy(req.uuid, uuid, sizeof(req.uuid));
	if ((rc = control_call(c, EMBD_CTL_DEVICE_REQUEST, &req, sizeof(req), "the service refused",
			       &msg)))
		goto out;
	rc = fail(c, EMBD_EPROTO, "device outputs: message type %u with %u fds answers the request",
		  msg.type, msg.nfds);
	if (msg.type != EMBD_CTL_DEVICE_OUTPUTS || msg.nfds != 1)
		goto out;
	if ((rc = embd_ctl_device_outputs_decode(&msg, rep, c->last_error, sizeof(c->last_error))))
		goto out;
	rc = fail(c, EMBD_EPROTO, "device outputs: buffers of %llu bytes, the layout's need %llu",
		  (unsigned long long)rep->buffer_bytes, (unsigned long long)rows);
	if (rep->buffer_bytes < rows)
		goto out;
	rc = fail(c, EMBD_EPROTO, "device outputs: the answer is for another GPU than asked");
	if (memcmp(rep->uuid, uuid, sizeof(rep->uuid)))
		goto out;
	rc = client_device_map(rep, msg.fds[0], cuda_device, &c->device, &base, c->last_error,
			       sizeof(c->last_error));
	msg.fds[0] = -1;        /* taken, whatever happened */
	msg.nfds = 0;
	if (rc)
		goto out;
	c->device_out = (struct embd_device_outputs){
		.cuda_device = cuda_device, .on_device = rep->memory == EMBD_CTL_MEMORY_CUDA,
		.buffer_bytes = rep->buffer_bytes };
	for (uint32_t s = 0; s < EMBD_CLIENT_SLOTS; s++) {
		c->device_out.pooled[s] = (float *)(void *)(base + rep->pooled[s]);
		c->device_out.grad[s] = (float *)(void *)(base + rep->grad[s]);
	}
	*out = c->device_out;
	c->last_error[0] = 0;
out:
	embd_ctl_msg_close_fds(&msg);
	return rc;
}

int embd_device_outputs(struct embd_client *c, int cuda_device, struct embd_device_outputs *out)
{
	uint8_t uuid[16];
	char why[sizeof(c->last_error) - 32];
	int rc;

	if (c->device)
		return fail(c, EMBD_EBUSY, "device outputs: this handle has them already");
	if ((rc = client_device_uuid(cuda_device, uuid, why, sizeof(why))))
		return fail(c, rc, "device outputs: %s", why);
	return embd_client_device_outputs_uuid(c, uuid, cuda_device, out);
}

/* ---- live table access --------------------------------------------------------------------- */

/*
 * One table request (TABLE_READ or TABLE_WRITE) and its answer into *rep; a read's rows are
 * copied to out. The service's refusal comes back as its code with its text.
 */
static int table_call(struct embd_client *c, enum embd_ctl_type type,
		      const struct embd_ctl_table_request *req, const int64_t *ids,
		      const float *rows, struct embd_ctl_table_reply *rep, float *out)
{
	struct embd_ctl_msg msg;
	const float *got;
	char what[32];
	uint32_t len;
	int rc;

	if (!c->table_buf && !(c->table_buf = malloc(EMBD_CTL_MSG_MAX)))
		return fail(c, EMBD_ENOMEM, "table: out of memory");
	if (embd_ctl_table_request_encode(req, ids, rows, c->table_buf, EMBD_CTL_MSG_MAX, &len))
		return fail(c, EMBD_EINVAL, "table: %u rows do not fit one message", req->num_rows);
	snprintf(what, sizeof(what), "table %u", req->table);
	if ((rc = control_call(c, type, c->table_buf, len, what, &msg)))
		return rc;
	if (msg.type != (type == EMBD_CTL_TABLE_READ ? EMBD_CTL_TABLE_DATA : EMBD_CTL_TABLE_DONE))
		return fail(c, EMBD_EPROTO, "table: message type %u answers a table request",
			    msg.type);
	if ((rc = embd_ctl_table_reply_decode(&msg, rep, &got, c->last_error,
					       sizeof(c->last_error))))
		return rc;
	if (rep->table != req->table || rep->array != req->array ||
	    rep->num_rows != req->num_rows || !rep->cols || rep->max_rows > EMBD_CTL_TABLE_BYTES_MAX)
		return fail(c, EMBD_EPROTO, "table: the answer names table %u array %u, %u rows",
			    rep->table, rep->array, rep->num_rows);
	if (out && got)
		memcpy(out, got, (size_t)rep->num_rows * rep->cols * sizeof(float));
	return 0;
}

int embd_table_info(struct embd_client *c, uint32_t table, enum embd_table_array array,
		    struct embd_table_info *out)
{
	struct embd_ctl_table_request req = { .table = table, .array = (uint32_t)array };
	struct embd_ctl_table_reply rep;
	int rc = table_call(c, EMBD_CTL_TABLE_READ, &req, NULL, NULL, &rep, NULL);

	if (rc)
		return rc;
	*out = (struct embd_table_info){ .num_embeddings = rep.num_embeddings, .cols = rep.cols,
					 .max_rows = rep.max_rows, .applied_step = rep.applied_step,
					 .optimizer_step = rep.optimizer_step };
	return 0;
}

/*
 * A read or write of n rows (ids, or row_begin onwards) in chunks of the most rows one message
 * carries. Reads fill out; writes send rows. Every chunk of a read must hold the same steps.
 */
static int table_chunks(struct embd_client *c, enum embd_ctl_type type, uint32_t table,
			enum embd_table_array array, const int64_t *ids, int64_t row_begin,
			uint64_t n, float *out, const float *rows, uint64_t *applied_step)
{
	struct embd_table_info info;
	int rc = embd_table_info(c, table, array, &info);

	if (rc)
		return rc;
	if (n > (uint64_t)INT64_MAX)
		return fail(c, EMBD_EINVAL, "num_rows: %llu", (unsigned long long)n);
	if (applied_step)
		*applied_step = info.applied_step;
	for (uint64_t done = 0; done < n;) {
		const uint32_t k = (uint32_t)(n - done < info.max_rows ? n - done : info.max_rows);
		struct embd_ctl_table_request req = {
			.table = table, .array = (uint32_t)array, .num_rows = k,
			.flags = ids ? EMBD_CTL_TABLE_IDS : 0,
			.row_begin = ids ? 0 : row_begin + (int64_t)done,
			.cols = type == EMBD_CTL_TABLE_WRITE ? info.cols : 0,
		};
		struct embd_ctl_table_reply rep;
		const uint64_t at = done * info.cols;
		rc = table_call(c, type, &req, ids ? ids + done : NULL, rows ? rows + at : NULL, &rep,
				out ? out + at : NULL);
		if (rc)
			return rc;
		if (rep.cols != info.cols)
			return fail(c, EMBD_EPROTO, "table %u: rows of %u floats, then of %u", table,
				    info.cols, rep.cols);
		if (type == EMBD_CTL_TABLE_READ && rep.applied_step != info.applied_step)
			return fail(c, EMBD_EAGAIN, "table %u: a step ran while it was read (the rows "
				    "of step %llu, then of %llu): read it between steps", table,
				    (unsigned long long)info.applied_step,
				    (unsigned long long)rep.applied_step);
		done += k;
	}
	return 0;
}

int embd_table_read(struct embd_client *c, uint32_t table, enum embd_table_array array,
		    int64_t row_begin, uint64_t num_rows, float *out, uint64_t *applied_step)
{
	return table_chunks(c, EMBD_CTL_TABLE_READ, table, array, NULL, row_begin, num_rows, out,
			    NULL, applied_step);
}

int embd_table_read_ids(struct embd_client *c, uint32_t table, enum embd_table_array array,
			const int64_t *ids, uint64_t num_ids, float *out, uint64_t *applied_step)
{
	return table_chunks(c, EMBD_CTL_TABLE_READ, table, array, ids, 0, num_ids, out, NULL,
			    applied_step);
}

int embd_table_write(struct embd_client *c, uint32_t table, enum embd_table_array array,
		     int64_t row_begin, uint64_t num_rows, const float *rows)
{
	return table_chunks(c, EMBD_CTL_TABLE_WRITE, table, array, NULL, row_begin, num_rows, NULL,
			    rows, NULL);
}

int embd_table_write_ids(struct embd_client *c, uint32_t table, enum embd_table_array array,
			 const int64_t *ids, uint64_t num_ids, const float *rows)
{
	return table_chunks(c, EMBD_CTL_TABLE_WRITE, table, array, ids, 0, num_ids, NULL, rows,
			    NULL);
}
