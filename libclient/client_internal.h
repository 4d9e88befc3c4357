/*
 * libclient/client_internal.h - libembdclient's functions below the public API, for the
 * integration tests and benchmarks that link the static library: they post descriptors the
 * public API would never build (malformed batches) through a real handle.
 */
#ifndef EMBD_LIBCLIENT_CLIENT_PRIV_H
#define EMBD_LIBCLIENT_CLIENT_PRIV_H

#include "embd/client.h"
#include "ipc/protocol.h"

/* The SQE embd_submit would post for req. Returns 0 or EMBD_EINVAL (field named). */
int embd_client_sqe_build(struct embd_client *client, const struct embd_request *req,
			  struct embd_sqe *sqe);

/* Pushes sqe as it is and rings the doorbell when the service sleeps. */
int embd_client_push_sqe(struct embd_client *client, const struct embd_sqe *sqe);

/* Bytes of the region's data slab. */
uint64_t embd_client_slab_bytes(const struct embd_client *client);

/* embd_device_outputs for the GPU with uuid, which this process need not see (no driver is
 * asked which GPU cuda_device is): what the service answers, a refusal or memory of either
 * kind, is taken as embd_device_outputs takes it. Tests on CPU ranks. */
int embd_client_device_outputs_uuid(struct embd_client *client, const uint8_t uuid[16],
				    int cuda_device, struct embd_device_outputs *out);

#endif /* EMBD_LIBCLIENT_CLIENT_PRIV_H */
