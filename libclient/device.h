/*
 * libclient/device.h - the trainer's side of device outputs (embd/client.h,
 * embd_device_outputs; ipc/README.md "Device outputs"): which GPU a CUDA device of this process
 * is, and the mapping of the memory the service exported for it. Private to libclient.
 */
#ifndef EMBD_LIBCLIENT_DEVICE_H
#define EMBD_LIBCLIENT_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "ipc/control.h"

struct client_device;

/* The UUID of this process's CUDA device `ordinal` (its numbering, after its
 * CUDA_VISIBLE_DEVICES). EMBD_ENOTSUP (no driver, a driver without the VMM API, no GPU),
 * EMBD_ENOENT (no such device), EMBD_EIO, with err. */
int client_device_uuid(int ordinal, uint8_t uuid[16], char *err, size_t err_len);

/*
 * Maps the memory rep describes, whose fd this takes (closed whatever happens): CUDA memory
 * imported (cuMemImportFromShareableHandle) and mapped readable and writable by device
 * `ordinal`, or the CPU ranks' host double with mmap. *base: the address of offset 0 (a device
 * pointer for CUDA memory). EMBD_ENOTSUP (no driver), EMBD_EPROTO (a host double that is not
 * sealed or too small), EMBD_ENOMEM, EMBD_EIO, with err.
 */
int client_device_map(const struct embd_ctl_device_outputs *rep, int fd, int ordinal,
		      struct client_device **out, uint8_t **base, char *err, size_t err_len);

/* Unmaps and releases (the service frees its side when the trainer leaves). NULL: no-op. */
void client_device_unmap(struct client_device *d);

#endif /* EMBD_LIBCLIENT_DEVICE_H */
