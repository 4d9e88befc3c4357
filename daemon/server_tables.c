/*
 * daemon/server_tables.c - live table access (ipc/control.h's TABLE_READ and TABLE_WRITE) on
 * the server's one thread. A request is handled when its socket event is, so between step
 * phases: the rows read hold every update whose backward ran, and rows written are what the
 * next forward reads (between a step's forward and its backward, that step's update lands on
 * them, as in TorchRec). A refusal is an ERROR reply; the client stays connected. Writes are
 * refused on a cluster: every node would have to agree on them at the same step boundary.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"
#include "daemon/server_internal.h"

/* The head of a reply to req: the array's shape and where the steps are. */
static int reply_head(struct embd_server *sv, const struct embd_ctl_table_request *req,
		      struct embd_ctl_table_reply *rep, char *err, size_t err_len)
{
	struct embd_step_table_info info;
	const struct embd_tables *t = &sv->config->tables;

	if (req->table >= t->count)
		return snprintf(err, err_len, "table %" PRIu32 ": the service has %u tables",
				req->table, t->count), EMBD_ENOENT;
	if (req->array > EMBD_STEP_MOMENTUM2 ||
	    embd_step_table_info(sv->step, req->table, (enum embd_step_array)req->array, &info) ||
	    !info.cols)
		return snprintf(err, err_len, "table '%s': array %" PRIu32 " (0 weights, 1 "
				"momentum1, 2 momentum2): its optimizer keeps no such state",
				t->specs[req->table].name, req->array), EMBD_EINVAL;
	*rep = (struct embd_ctl_table_reply){
		.table = req->table, .array = req->array, .cols = info.cols,
		.num_embeddings = info.num_embeddings, .applied_step = embd_server_step(sv),
		.optimizer_step = info.optimizer_step, .max_rows = embd_ctl_table_max_rows(info.cols),
	};
	if (req->num_rows > rep->max_rows)
		return snprintf(err, err_len, "table '%s': %" PRIu32 " rows of %" PRIu32 " floats in "
				"one message, at most %" PRIu32, t->specs[req->table].name,
				req->num_rows, info.cols, rep->max_rows), EMBD_EINVAL;
	return 0;
}

/* Serves the request; 0 with the reply encoded in sv->msgbuf, or the refusal. */
static int serve(struct embd_server *sv, const struct embd_ctl_msg *msg, uint16_t *type,
		 uint32_t *len, char *err, size_t err_len)
{
	struct embd_ctl_table_request req;
	struct embd_ctl_table_reply rep;
	const int64_t *ids;
	const float *rows;
	int rc = embd_ctl_table_request_decode(msg, &req, &ids, &rows, err, err_len);

	if (!rc)
		rc = reply_head(sv, &req, &rep, err, err_len);
	if (rc)
		return rc;
	const struct embd_step_rows which = { .ids = ids, .row_begin = req.row_begin,
					      .n = req.num_rows };
	const enum embd_step_array a = (enum embd_step_array)req.array;
	rep.num_rows = req.num_rows;
	if (msg->type == EMBD_CTL_TABLE_READ) {
		/* the rows go out of the message buffer the request came in: read them aside */
		float *out = malloc(((uint64_t)req.num_rows * rep.cols + 1) * sizeof(float));
		if (!out)
			return snprintf(err, err_len, "out of memory"), EMBD_ENOMEM;
		rc = embd_step_table_read(sv->step, req.table, a, &which, out, err, err_len);
		*type = EMBD_CTL_TABLE_DATA;
		if (!rc)
			rc = embd_ctl_table_reply_encode(EMBD_CTL_TABLE_DATA, &rep, out, sv->msgbuf,
							 EMBD_CTL_MSG_MAX, len);
		free(out);
		return rc;
	}
	if (sv->cluster)
		return snprintf(err, err_len, "table writes on a cluster are not supported: every "
				"node would have to agree on them (embctl import with the cluster "
				"stopped)"), EMBD_ENOTSUP;
	if (req.cols != rep.cols)
		return snprintf(err, err_len, "table.cols: %" PRIu32 " floats per row, array %" PRIu32
				" of table '%s' has %" PRIu32, req.cols, req.array,
				sv->config->tables.specs[req.table].name, rep.cols), EMBD_EINVAL;
	rc = embd_step_table_write(sv->step, req.table, a, &which, rows, err, err_len);
	*type = EMBD_CTL_TABLE_DONE;
	if (!rc) {
		embd_log_info("table '%s': %" PRIu32 " rows of array %" PRIu32 " written before step %"
			      PRIu64, sv->config->tables.specs[req.table].name, req.num_rows,
			      req.array, embd_server_step(sv));
		rc = embd_ctl_table_reply_encode(EMBD_CTL_TABLE_DONE, &rep, NULL, sv->msgbuf,
						 EMBD_CTL_MSG_MAX, len);
	}
	return rc;
}

int embd_server_table_request(struct embd_server *sv, struct client *c,
			      const struct embd_ctl_msg *msg, char *err, size_t err_len)
{
	uint16_t type = 0;
	uint32_t len = 0;
	char why[256] = "";
	int rc = serve(sv, msg, &type, &len, why, sizeof(why));

	if (rc)
		return embd_ctl_send_error(c->sock, rc, why, err, err_len);
	return embd_ctl_send(c->sock, type, sv->msgbuf, len, NULL, 0, err, err_len);
}
