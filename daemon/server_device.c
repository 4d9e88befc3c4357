/*
 * daemon/server_device.c - device outputs (ipc/README.md "Device outputs"): a trainer's pooled
 * outputs and gradients in memory of its GPU, on the server's one thread.
 *
 * The engine computes every output in host memory as ever. For a request with EMBD_SQE_DEVICE
 * it writes the trainer's rows into a staging buffer of the trainer's own (registered with the
 * ranks, so GPU ranks copy into it by DMA), and once the forward is done one copy takes them to
 * the trainer's device buffer; a gradient comes out of its device buffer in one copy into the
 * server's gradient buffer, where the engine checks it and uses that same copy
 * (server_schedule.c's copy_grads, as for the slab). So a GPU trainer never moves embeddings
 * through host memory; the service still does, once each way, because row-split outputs are
 * assembled and gradients checked on the host (the ranks writing straight into the trainer's
 * GPU is not done). A refusal is an ERROR reply; the trainer stays and keeps its slab.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cuda_driver.h"
#include "common/log.h"
#include "ipc/region.h"
#include "daemon/server_internal.h"

_Static_assert((int)EMBD_EXPORT_CUDA == (int)EMBD_CTL_MEMORY_CUDA &&
	       (int)EMBD_EXPORT_HOST == (int)EMBD_CTL_MEMORY_HOST,
	       "the engine's memory kinds are the wire's");

static uint64_t round_up(uint64_t x, uint64_t to)
{
	return (x + to - 1) / to * to;
}

/* Bytes of one trainer's pooled rows (or gradient) at the layout's batch size. */
static uint64_t rows_bytes(const struct embd_server *sv)
{
	const struct embd_step_layout *l = embd_step_layout(sv->step);

	return (uint64_t)l->batch_size * l->total_dim * sizeof(float);
}

void embd_server_device_free(struct embd_server *sv, struct client *c)
{
	embd_ranks_dma_free(sv->ranks, c->staging, c->staging_registered);
	if (c->has_device)
		embd_ranks_export_free(sv->ranks, &c->device);
	c->staging = NULL;
	c->staging_registered = c->has_device = false;
	c->limits.device_bytes = 0;
}

/* The device buffers of trainer c on the GPU req names, and the reply that describes them; or
 * why not (err, the refusal's code). */
static int grant(struct embd_server *sv, struct client *c, const struct embd_ctl_device_request *req,
		 struct embd_ctl_device_outputs *rep, char *err, size_t err_len)
{
	const uint64_t rows = rows_bytes(sv), stride = round_up(rows, EMBD_CTL_DEVICE_ALIGN);
	char inner[EMBD_CTL_TEXT_MAX - 32];     /* a CUDA refusal lists the GPUs it sees */
	int rc;

	if (c->index < 0)
		return snprintf(err, err_len, "device outputs: only a trainer asks for them, after its "
				"HELLO was welcomed"), EMBD_EINVAL;
	if (c->has_device)
		return snprintf(err, err_len, "device outputs: trainer %d has them already (one set "
				"per connection)", c->index), EMBD_EBUSY;
	rc = embd_ranks_export_alloc(sv->ranks, req->uuid, 2 * EMBD_CTL_DEVICE_SLOTS * stride,
				     &c->device, inner, sizeof(inner));
	if (rc)
		return snprintf(err, err_len, "device outputs: %s", inner), rc;
	c->has_device = true;
	c->staging = embd_ranks_dma_alloc(sv->ranks, rows, &c->staging_registered,
					  "device outputs' staging rows");
	if (!c->staging) {
		snprintf(err, err_len, "device outputs: out of memory for %" PRIu64 " bytes", rows);
		rc = EMBD_ENOMEM;
		goto fail;
	}
	*rep = (struct embd_ctl_device_outputs){
		.memory = (uint32_t)c->device.memory, .num_slots = EMBD_CTL_DEVICE_SLOTS,
		.bytes = c->device.bytes, .buffer_bytes = rows,
	};
	memcpy(rep->uuid, req->uuid, sizeof(rep->uuid));
	for (uint32_t s = 0; s < EMBD_CTL_DEVICE_SLOTS; s++) {
		rep->pooled[s] = 2 * s * stride;
		rep->grad[s] = (2 * s + 1) * stride;
	}
	c->limits.device_bytes = c->device.bytes;
	return 0;
fail:
	embd_server_device_free(sv, c);
	return rc;
}

int embd_server_device_request(struct embd_server *sv, struct client *c,
			       const struct embd_ctl_msg *msg, char *err, size_t err_len)
{
	struct embd_ctl_device_request req;
	struct embd_ctl_device_outputs rep;
	char why[EMBD_CTL_TEXT_MAX], gpu[EMBD_CUDA_UUID_TEXT];
	int rc = embd_ctl_device_request_decode(msg, &req, why, sizeof(why));

	if (!rc)
		rc = grant(sv, c, &req, &rep, why, sizeof(why));
	if (rc) {
		embd_log_info("trainer %d (pid %d): %s", c->index, (int)c->peer.pid, why);
		return embd_ctl_send_error(c->sock, rc, why, err, err_len);
	}
	rc = embd_ctl_send(c->sock, EMBD_CTL_DEVICE_OUTPUTS, &rep, sizeof(rep), &c->device.fd, 1,
			   err, err_len);
	/* the trainer's copy of the fd (or, until it reads it, the socket's) keeps the memory */
	close(c->device.fd);
	c->device.fd = -1;
	if (!rc)
		embd_log_info("trainer %d (pid %d): pooled outputs and gradients on GPU %s (%s, %"
			      PRIu64 " bytes)", c->index, (int)c->peer.pid,
			      embd_cuda_uuid_text(req.uuid, gpu),
			      c->device.memory == EMBD_EXPORT_CUDA ? "CUDA memory" :
			      "host memory: the CPU ranks' test double", c->device.bytes);
	return rc;
}

float *embd_server_output(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe)
{
	(void)sv;
	if (sqe->flags & EMBD_SQE_DEVICE)
		return c->staging;
	return (float *)((uint8_t *)embd_region_slab(c->region) + sqe->output.offset);
}

int embd_server_output_done(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
			    char *err, size_t err_len)
{
	if (!(sqe->flags & EMBD_SQE_DEVICE))
		return 0;
	/* the span's bytes are the batch's b rows (embd_sqe_validate) */
	return embd_ranks_export_copy(sv->ranks, &c->device, sqe->output.offset, c->staging,
				      sqe->output.bytes, true, err, err_len);
}

int embd_server_grad_in(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
			float *to, struct embd_step_batch *b, char *err, size_t err_len)
{
	b->grad_copy = to;
	if (!(sqe->flags & EMBD_SQE_DEVICE)) {
		b->pooled_grad = NULL;
		b->grad_from = (const float *)((const uint8_t *)embd_region_slab(c->region) +
					       sqe->grad.offset);
		return 0;
	}
	b->pooled_grad = to;
	b->grad_from = NULL;
	return embd_ranks_export_copy(sv->ranks, &c->device, sqe->grad.offset, to, sqe->grad.bytes,
				      false, err, err_len);
}
