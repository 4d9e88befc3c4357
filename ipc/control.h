/*
 * ipc/control.h - the control socket between a client (trainer or embctl) and the service:
 * Unix SOCK_SEQPACKET, one message per packet, a 16-byte header and a typed payload.
 *
 * The one idea: everything that arrives is untrusted bytes. embd_ctl_parse checks the header
 * and the payload length of each type; the per-type decoders copy fields into private structs
 * and check every count, index and string, naming the field in the error. Only WELCOME (the
 * region memfd, optionally an eventfd) and DEVICE_OUTPUTS (the device memory's fd) may carry
 * file descriptors; any other passed fd is closed and refused. Wire format and message
 * sequence: ipc/README.md.
 */
#ifndef EMBD_IPC_CONTROL_H
#define EMBD_IPC_CONTROL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "embd/types.h"

#define EMBD_CTL_MAGIC 0x4c43424du      /* "MBCL" little-endian */
/* The protocol's one version (ipc/README.md "Versions"): 2 added DEVICE_REQUEST and
 * DEVICE_OUTPUTS. HELLO and ERROR keep their layout in every version, so that each side can
 * tell the other which version it speaks. */
#define EMBD_CTL_VERSION 2u
#define EMBD_CTL_MSG_MAX (256u * 1024u) /* bytes of one packet, header included */
#define EMBD_CTL_FDS_MAX 2              /* fds one message may carry */
#define EMBD_CTL_TEXT_MAX 1024u         /* bytes of an ERROR message, NUL excluded */
#define EMBD_LAYOUT_TABLES_MAX 256u
#define EMBD_LAYOUT_FEATURES_MAX 1024u

enum embd_ctl_type {
	EMBD_CTL_HELLO = 1,             /* client -> service: struct embd_ctl_hello */
	EMBD_CTL_WELCOME = 2,           /* service -> client: layout; fds: memfd [, eventfd] */
	EMBD_CTL_ERROR = 3,             /* either way: int32 code + text */
	EMBD_CTL_STATS_REQUEST = 4,     /* embctl -> service: empty */
	EMBD_CTL_STATS_REPLY = 5,       /* service -> embctl: JSON text */
	EMBD_CTL_STATUS_REQUEST = 6,    /* embctl -> service: empty */
	EMBD_CTL_STATUS_REPLY = 7,      /* service -> embctl: JSON text */
	EMBD_CTL_CHECKPOINT_REQUEST = 8,/* embctl -> service: struct embd_ctl_checkpoint */
	EMBD_CTL_CHECKPOINT_REPLY = 9,  /* service -> embctl: JSON text (ckpt_service.h) */
	EMBD_CTL_TABLE_READ = 10,       /* client -> service: struct embd_ctl_table_request, ids */
	EMBD_CTL_TABLE_DATA = 11,       /* service -> client: struct embd_ctl_table_reply, rows */
	EMBD_CTL_TABLE_WRITE = 12,      /* client -> service: the request, ids, rows */
	EMBD_CTL_TABLE_DONE = 13,       /* service -> client: struct embd_ctl_table_reply */
	EMBD_CTL_DEVICE_REQUEST = 14,   /* trainer -> service: struct embd_ctl_device_request */
	EMBD_CTL_DEVICE_OUTPUTS = 15,   /* service -> trainer: struct embd_ctl_device_outputs;
					 * fd: the memory */
};

/* Wire header of every message (host byte order: both ends are on one machine). */
struct embd_ctl_header {
	uint32_t magic;
	uint16_t version;
	uint16_t type;                  /* enum embd_ctl_type */
	uint32_t length;                /* payload bytes after the header */
	uint32_t reserved;              /* zero */
};
_Static_assert(sizeof(struct embd_ctl_header) == 16, "control header is 16 bytes");

/* HELLO payload. */
struct embd_ctl_hello {
	uint32_t protocol_version;      /* EMBD_CTL_VERSION */
	int32_t wanted_rank;            /* local rank the trainer wants, or -1 for any */
	int32_t pid;                    /* informational; the service trusts SO_PEERCRED */
	uint32_t reserved;              /* zero */
};

/* CHECKPOINT_REQUEST payload: take a checkpoint now (at the next moment no step phase runs).
 * Without WAIT the reply comes once the snapshot is taken ({"started": seq}); with WAIT once
 * the checkpoint is on disk (its result). */
#define EMBD_CTL_CHECKPOINT_WAIT (1u << 0)
struct embd_ctl_checkpoint {
	uint32_t flags;                 /* EMBD_CTL_CHECKPOINT_WAIT */
	uint32_t reserved;              /* zero */
};

/*
 * Live table access: rows of one array of one table read (TABLE_READ -> TABLE_DATA) or written
 * (TABLE_WRITE -> TABLE_DONE) between steps, in table coordinates (engine/step.h's live table
 * access); a refusal is an ERROR reply and the connection stays. A message carries at most
 * EMBD_CTL_TABLE_BYTES_MAX bytes of ids and rows: the reply's max_rows says how many rows of
 * the array fit, and a client splits larger tables into such chunks. Arrays: 0 weights, 1
 * momentum1, 2 momentum2 (embd/client.h's enum embd_table_array).
 */
#define EMBD_CTL_TABLE_BYTES_MAX (128u * 1024u)
#define EMBD_CTL_TABLE_IDS (1u << 0)    /* the rows are named by num_rows int64 ids */

struct embd_ctl_table_request {
	uint32_t table;                 /* index into the layout's tables */
	uint32_t array;                 /* 0 weights, 1 momentum1, 2 momentum2 */
	uint32_t flags;                 /* EMBD_CTL_TABLE_IDS */
	uint32_t num_rows;              /* rows of this message; 0: only the reply's head */
	int64_t row_begin;              /* without IDS: the first of num_rows rows; with: 0 */
	uint32_t cols;                  /* TABLE_WRITE: floats per row that follow; READ: 0 */
	uint32_t reserved;              /* zero */
};
/* then int64 ids[num_rows] with IDS, then (TABLE_WRITE) float rows[num_rows][cols] */

struct embd_ctl_table_reply {
	uint32_t table, array;
	uint32_t cols;                  /* floats per row of the array */
	uint32_t num_rows;              /* rows read (that follow) or written */
	int64_t num_embeddings;         /* rows of the table */
	uint64_t applied_step;          /* the rows hold the updates of every step before it */
	int64_t optimizer_step;         /* the table's optimizer steps (adam's t) */
	uint32_t max_rows;              /* most rows of this array one message carries */
	uint32_t reserved;              /* zero */
};
/* then (TABLE_DATA) float rows[num_rows][cols] */

/* Rows of cols floats one table message carries, ids included. */
static inline uint32_t embd_ctl_table_max_rows(uint32_t cols)
{
	return EMBD_CTL_TABLE_BYTES_MAX / (8u + 4u * cols);
}

/*
 * Device outputs (ipc/README.md "Device outputs"): a trainer asks, any time after WELCOME and
 * once per connection, for its pooled outputs and gradients in memory of its GPU, named by
 * the GPU's UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES renumbers). The
 * service answers DEVICE_OUTPUTS with one fd and the buffers' offsets in it, or an ERROR that
 * says why not (the connection stays, the slab's buffers keep working). Requests that use the
 * buffers carry EMBD_SQE_DEVICE (protocol.h).
 */
#define EMBD_CTL_DEVICE_SLOTS 2         /* a pooled and a grad buffer per batch slot */
#define EMBD_CTL_DEVICE_ALIGN 256u      /* buffers start on multiples of it */
#define EMBD_CTL_DEVICE_BYTES_MAX (UINT64_C(1) << 40)

struct embd_ctl_device_request {
	uint8_t uuid[16];               /* the GPU: cuDeviceGetUuid_v2 of the trainer's device */
	uint32_t flags;                 /* zero (none defined) */
	uint32_t reserved;              /* zero */
};
_Static_assert(sizeof(struct embd_ctl_device_request) == 24, "no padding on the wire");

/* What DEVICE_OUTPUTS' fd is. */
enum embd_ctl_memory {
	EMBD_CTL_MEMORY_CUDA = 1,       /* a CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR handle of a
					 * cuMemCreate allocation on the GPU asked for */
	EMBD_CTL_MEMORY_HOST = 2,       /* a sealed memfd of host memory: CPU ranks' test double
					 * (EMBD_TEST_CPU_DEVICE_OUTPUTS), never otherwise */
};

struct embd_ctl_device_outputs {
	uint8_t uuid[16];               /* the request's GPU */
	uint32_t memory;                /* enum embd_ctl_memory */
	uint32_t num_slots;             /* EMBD_CTL_DEVICE_SLOTS */
	uint64_t bytes;                 /* of the allocation: the importer maps [0, bytes) */
	uint64_t buffer_bytes;          /* of each buffer: the layout's batch_size x total_dim
					 * floats at least */
	uint64_t pooled[EMBD_CTL_DEVICE_SLOTS];     /* offsets of slot s's buffers */
	uint64_t grad[EMBD_CTL_DEVICE_SLOTS];
};
_Static_assert(sizeof(struct embd_ctl_device_outputs) == 72, "no padding on the wire");

/* One table as a client sees it. */
struct embd_layout_table {
	char name[EMBD_NAME_MAX];
	int64_t num_embeddings;
	int32_t embedding_dim;
	uint32_t pooling;               /* enum embd_pooling */
	uint32_t data_type;             /* enum embd_data_type */
	uint32_t reserved;
};

/* One feature: which table it looks up and where its columns sit in the pooled output. */
struct embd_layout_feature {
	char name[EMBD_NAME_MAX];
	uint32_t table;                 /* index into tables */
	uint32_t dim;                   /* == the table's embedding_dim */
	uint32_t offset;                /* first column in the pooled output */
	uint32_t reserved;
};

/*
 * The WELCOME payload, deserialised: everything a client needs to build batches.
 * Wire form (ipc/README.md): struct embd_layout_fixed, then num_tables embd_layout_table,
 * then num_features embd_layout_feature, all packed in that order.
 */
struct embd_layout_fixed {
	int32_t rank;                   /* assigned local rank */
	uint32_t local_world_size;
	uint64_t region_bytes;          /* size of the memfd that comes with the message */
	uint64_t resumed_step;          /* first step to train (0, or a restored checkpoint's) */
	uint64_t max_values;            /* cap on ids per batch */
	uint32_t batch_size;
	uint32_t total_dim;             /* columns of the pooled output */
	uint32_t num_tables;
	uint32_t num_features;
	uint32_t flags;                 /* EMBD_LAYOUT_EVENTFD: a second fd, the SQ eventfd */
	uint32_t reserved;
};
#define EMBD_LAYOUT_EVENTFD (1u << 0)

struct embd_layout {
	struct embd_layout_fixed fixed;
	struct embd_layout_table tables[EMBD_LAYOUT_TABLES_MAX];
	struct embd_layout_feature features[EMBD_LAYOUT_FEATURES_MAX];
};

/* A received message: payload points into the caller's buffer; fds are owned by the caller. */
struct embd_ctl_msg {
	uint16_t type;
	uint16_t version;               /* the header's: EMBD_CTL_VERSION but for HELLO and ERROR */
	uint32_t length;
	const uint8_t *payload;
	int fds[EMBD_CTL_FDS_MAX];
	unsigned nfds;
};

/* The peer of a Unix socket, from SO_PEERCRED and SO_PEERGROUPS. */
#define EMBD_CTL_GROUPS_MAX 64
struct embd_ctl_peer {
	pid_t pid;
	uid_t uid;
	gid_t gid;                      /* primary */
	unsigned num_groups;            /* supplementary groups (capped at EMBD_CTL_GROUPS_MAX) */
	gid_t groups[EMBD_CTL_GROUPS_MAX];
};

/* ---- sockets ---------------------------------------------------------------------------- */

/*
 * Binds and listens on `path` (SOCK_SEQPACKET, close-on-exec, with file mode `mode`, set
 * before the path appears). A stale socket file that nobody listens on is replaced; a live
 * one gives EMBD_EBUSY. Who may connect is decided by SO_PEERCRED (embd_ctl_peer_check): the
 * mode only has to let those peers reach the socket.
 */
int embd_ctl_listen(const char *path, int backlog, mode_t mode, int *fd_out, char *err,
		    size_t err_len);

/* Connects to `path`. Returns 0, EMBD_ENOENT (no socket), EMBD_ECONNRESET (refused),
 * EMBD_EACCES (the socket's mode or a directory's keeps this uid out), EMBD_EIO. */
int embd_ctl_connect(const char *path, int *fd_out, char *err, size_t err_len);

/* Reads the peer's pid/uid/gid/groups. Returns 0 or EMBD_EIO. */
int embd_ctl_peer_get(int sock, struct embd_ctl_peer *peer, char *err, size_t err_len);

/*
 * A pidfd of the process that connected `sock` (close-on-exec), which becomes readable when
 * that process exits even if a child it forked still holds the socket. Taken race-free with
 * SO_PEERPIDFD (Linux 6.5) where the kernel has it, else pidfd_open(peer_pid) (peer_pid from
 * embd_ctl_peer_get). Returns 0, EMBD_ECONNRESET when the peer is already gone, or
 * EMBD_ENOTSUP (no pidfd: an old kernel, or a peer in another pid namespace, whose pid is 0).
 */
int embd_ctl_peer_pidfd(int sock, pid_t peer_pid, int *pidfd_out, char *err, size_t err_len);

/*
 * Allows the peer when its uid is in `uids` or its primary or any supplementary gid is in
 * `gids`; empty lists allow nobody. Returns 0 or EMBD_EACCES with the uid/gid named in err.
 */
int embd_ctl_peer_check(const struct embd_ctl_peer *peer, const uid_t *uids, size_t num_uids,
			const gid_t *gids, size_t num_gids, char *err, size_t err_len);

/* ---- messages --------------------------------------------------------------------------- */

/*
 * Sends one message of `type` with `length` payload bytes and up to EMBD_CTL_FDS_MAX fds
 * (SCM_RIGHTS). Returns 0, EMBD_EINVAL (too long, too many fds), EMBD_ECONNRESET, EMBD_EIO.
 */
int embd_ctl_send(int sock, enum embd_ctl_type type, const void *payload, uint32_t length,
		  const int *fds, unsigned nfds, char *err, size_t err_len);

/*
 * Receives one message into buf (EMBD_CTL_MSG_MAX bytes is always enough), waiting at most
 * timeout_ms (< 0: no limit), and parses it with embd_ctl_parse. Received fds are
 * close-on-exec; on any error they are closed. Returns 0, EMBD_ETIMEDOUT, EMBD_ECONNRESET
 * (peer closed), EMBD_EPROTO (truncated packet, bad header, unexpected fds), EMBD_EIO.
 */
int embd_ctl_recv(int sock, void *buf, size_t buf_bytes, int timeout_ms, struct embd_ctl_msg *msg,
		  char *err, size_t err_len);

/*
 * Checks a packet's header (magic, version, known type, reserved, length == bytes after the
 * header, within EMBD_CTL_MSG_MAX) and the payload size its type requires. On success
 * msg->payload points into `bytes`; msg->nfds is 0. Returns 0 or EMBD_EPROTO.
 */
int embd_ctl_parse(const void *bytes, size_t len, struct embd_ctl_msg *msg, char *err, size_t err_len);

/* HELLO: encode into a payload / decode from a parsed message (EMBD_EPROTO names the field). */
void embd_ctl_hello_encode(const struct embd_ctl_hello *hello, void *payload_out);
int embd_ctl_hello_decode(const struct embd_ctl_msg *msg, struct embd_ctl_hello *out, char *err,
			  size_t err_len);

/*
 * WELCOME: serialises `layout` into buf (cap bytes), length in *len_out; EMBD_ENOSPC when it
 * does not fit. decode checks counts against the caps and the payload length, NUL-terminated
 * unique names, table indices, dims equal to the table's, offsets that tile [0, total_dim)
 * in feature order without gaps, pooling/data type values, and reserved fields.
 */
int embd_ctl_welcome_encode(const struct embd_layout *layout, void *buf, size_t cap, uint32_t *len_out);
int embd_ctl_welcome_decode(const struct embd_ctl_msg *msg, struct embd_layout *out, char *err,
			    size_t err_len);

/* ERROR: code (negative EMBD_E*) and text (truncated to EMBD_CTL_TEXT_MAX). */
int embd_ctl_send_error(int sock, int code, const char *text, char *err, size_t err_len);

/*
 * Refuses a connection: sends ERROR, stops reading, discards what the peer already sent (its
 * HELLO, any fds) and closes `sock`. Closing a Unix socket with unread input would make the
 * peer's next recv fail with ECONNRESET before it ever sees the ERROR; a peer whose HELLO
 * comes later finds the socket shut and reads the queued ERROR (libembdclient does).
 */
void embd_ctl_refuse(int sock, int code, const char *text);
int embd_ctl_error_decode(const struct embd_ctl_msg *msg, int *code_out, char *text, size_t text_cap,
			  char *err, size_t err_len);

/*
 * STATS_REPLY / STATUS_REPLY / CHECKPOINT_REPLY: copies the text payload into text (text_cap bytes, NUL added);
 * EMBD_EPROTO for an embedded NUL, EMBD_ENOSPC when it does not fit.
 */
int embd_ctl_text_decode(const struct embd_ctl_msg *msg, char *text, size_t text_cap, char *err,
			 size_t err_len);

/* CHECKPOINT_REQUEST: decode checks flags and reserved (EMBD_EPROTO names the field). */
int embd_ctl_checkpoint_decode(const struct embd_ctl_msg *msg, struct embd_ctl_checkpoint *out,
			       char *err, size_t err_len);

/*
 * TABLE_READ / TABLE_WRITE: the request, then num_rows ids (with EMBD_CTL_TABLE_IDS), then
 * num_rows x cols floats of rows (TABLE_WRITE), into buf (cap bytes); EMBD_EINVAL when it would
 * not fit a table message.
 */
int embd_ctl_table_request_encode(const struct embd_ctl_table_request *req, const int64_t *ids,
				  const float *rows, void *buf, size_t cap, uint32_t *len_out);
/*
 * Checks a TABLE_READ / TABLE_WRITE (flags, reserved, row_begin 0 with ids, cols 0 for a
 * read, num_rows within a table message's rows, exactly the ids and rows it announces) and
 * points *ids (NULL without IDS) and *rows (NULL for a read) into the payload, which must be
 * 8-byte aligned as embd_ctl_recv's buffer is. EMBD_EPROTO naming the field.
 */
int embd_ctl_table_request_decode(const struct embd_ctl_msg *msg, struct embd_ctl_table_request *out,
				  const int64_t **ids, const float **rows, char *err, size_t err_len);
/* TABLE_DATA (with num_rows x cols floats of rows) / TABLE_DONE (rows NULL) into buf. */
int embd_ctl_table_reply_encode(enum embd_ctl_type type, const struct embd_ctl_table_reply *rep,
				const float *rows, void *buf, size_t cap, uint32_t *len_out);
/* Checks a TABLE_DATA / TABLE_DONE (the rows a DATA announces, reserved) and points *rows into
 * the payload (NULL for DONE). EMBD_EPROTO naming the field. */
int embd_ctl_table_reply_decode(const struct embd_ctl_msg *msg, struct embd_ctl_table_reply *out,
				const float **rows, char *err, size_t err_len);

/* DEVICE_REQUEST: decode checks flags and reserved (EMBD_EPROTO naming the field). */
int embd_ctl_device_request_decode(const struct embd_ctl_msg *msg,
				   struct embd_ctl_device_request *out, char *err, size_t err_len);
/*
 * DEVICE_OUTPUTS: decode checks the memory kind, the slot count, bytes within
 * EMBD_CTL_DEVICE_BYTES_MAX, and that every buffer is EMBD_CTL_DEVICE_ALIGN-aligned, inside
 * [0, bytes) and apart from the others; with fds (msg->nfds != 0), exactly one. EMBD_EPROTO
 * naming the field.
 */
int embd_ctl_device_outputs_decode(const struct embd_ctl_msg *msg,
				   struct embd_ctl_device_outputs *out, char *err, size_t err_len);

/* Closes the fds a message carries and clears msg->nfds (for refused messages). */
void embd_ctl_msg_close_fds(struct embd_ctl_msg *msg);

#endif /* EMBD_IPC_CONTROL_H */
