/*
 * embd/types.h - the vocabulary every part of embd shares: tables, KJT batches, the pooled
 * output layout and error codes.
 *
 * Names follow TorchRec (EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor) so that a
 * TorchRec user reads them without a glossary. This is the only header that the planner,
 * kernels and ipc modules share; it holds plain data and no behaviour beyond embd_strerror().
 *
 * Error convention (liburing's): functions return 0 on success or a negative EMBD_E* code;
 * results go through out-parameters. Codes reuse errno values where one fits, so
 * strerror(-rc) is also meaningful for those.
 */
#ifndef EMBD_TYPES_H
#define EMBD_TYPES_H

#include <errno.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- error codes ------------------------------------------------------------------------ */

enum embd_error {
	EMBD_OK = 0,
	EMBD_EINVAL = -EINVAL,             /* a field of an argument or a request is invalid */
	EMBD_ENOMEM = -ENOMEM,             /* an allocation failed */
	EMBD_ERANGE = -ERANGE,             /* an id, offset or length is out of its bounds */
	EMBD_ENOENT = -ENOENT,             /* a named table, feature, file or key does not exist */
	EMBD_EIO = -EIO,                   /* reading or writing a file or socket failed */
	EMBD_EACCES = -EACCES,             /* a peer is not allowed (uid/gid) */
	EMBD_ETIMEDOUT = -ETIMEDOUT,       /* a wait, collective or store operation timed out */
	EMBD_EPROTO = -EPROTO,             /* a peer broke the wire protocol */
	EMBD_ECONNRESET = -ECONNRESET,     /* the peer went away */
	EMBD_ENOSPC = -ENOSPC,             /* does not fit: memory caps, ring full, slab too small */
	EMBD_EBUSY = -EBUSY,               /* resource in use, retry later */
	EMBD_EAGAIN = -EAGAIN,             /* nothing ready yet (non-blocking calls) */
	EMBD_ECANCELED = -ECANCELED,       /* the step was aborted for the cluster */
	EMBD_ENOTSUP = -ENOTSUP,           /* valid but not supported by this build or device */
	/* embd-specific codes, outside the errno range */
	EMBD_EPARSE = -1001,               /* a file or message is malformed */
	EMBD_EMISMATCH = -1002,            /* peers or files disagree (version, tables, plan hash) */
	EMBD_EINFEASIBLE = -1003,          /* the planner found no placement within the caps */
	EMBD_ECHECKSUM = -1004,            /* a stored file does not match its checksum */
	EMBD_ERESUMED = -1005,             /* the cluster re-formed and resumed at another step:
					      the completion's step is the one to post next */
};

/* A short static description of an EMBD_E* code (never NULL). */
static inline const char *embd_strerror(int err)
{
	switch (err) {
	case EMBD_OK: return "success";
	case EMBD_EINVAL: return "invalid argument";
	case EMBD_ENOMEM: return "out of memory";
	case EMBD_ERANGE: return "value out of range";
	case EMBD_ENOENT: return "not found";
	case EMBD_EIO: return "I/O error";
	case EMBD_EACCES: return "permission denied";
	case EMBD_ETIMEDOUT: return "timed out";
	case EMBD_EPROTO: return "protocol error";
	case EMBD_ECONNRESET: return "connection reset by peer";
	case EMBD_ENOSPC: return "no space";
	case EMBD_EBUSY: return "busy";
	case EMBD_EAGAIN: return "try again";
	case EMBD_ECANCELED: return "step aborted";
	case EMBD_ENOTSUP: return "not supported";
	case EMBD_EPARSE: return "malformed input";
	case EMBD_EMISMATCH: return "mismatch between peers or files";
	case EMBD_EINFEASIBLE: return "no feasible placement";
	case EMBD_ECHECKSUM: return "checksum mismatch";
	case EMBD_ERESUMED: return "cluster resumed at another step";
	default: return "unknown error";
	}
}

/* ---- tables ----------------------------------------------------------------------------- */

#define EMBD_NAME_MAX 64            /* bytes of a table or feature name, NUL included */
#define EMBD_TABLE_FEATURES_MAX 16  /* features one table may serve */

enum embd_pooling {
	EMBD_POOLING_SUM = 0,
	EMBD_POOLING_MEAN = 1,          /* mean of an empty bag is 0, as in TorchRec */
};

enum embd_data_type {
	EMBD_DTYPE_FP32 = 0,
	EMBD_DTYPE_FP16 = 1,            /* IEEE binary16 rows; arithmetic accumulates in fp32 */
};

/* Fused optimizers (FBGEMM's EXACT_* semantics: duplicate ids of a step are combined first). */
enum embd_optimizer_type {
	EMBD_OPT_SGD = 0,
	EMBD_OPT_ADAGRAD = 1,           /* one state value per weight */
	EMBD_OPT_ROWWISE_ADAGRAD = 2,   /* one state value per row */
	EMBD_OPT_ADAM = 3,              /* two state values (m, v) per weight */
};

struct embd_optimizer_spec {
	enum embd_optimizer_type type;
	float lr;
	float eps;                      /* adagrad, rowwise_adagrad, adam */
	float beta1, beta2;             /* adam */
	float weight_decay;             /* L2 added to the gradient; 0 disables */
};

struct embd_table_spec {
	char name[EMBD_NAME_MAX];
	int64_t num_embeddings;         /* rows */
	int32_t embedding_dim;          /* columns */
	enum embd_pooling pooling;
	enum embd_data_type data_type;
	struct embd_optimizer_spec optimizer;
	uint32_t num_features;
	char feature_names[EMBD_TABLE_FEATURES_MAX][EMBD_NAME_MAX];
};

/* Bytes of one element of a row stored as `type`. */
static inline uint32_t embd_dtype_bytes(enum embd_data_type type)
{
	return type == EMBD_DTYPE_FP16 ? 2u : 4u;
}

/* ---- batches ---------------------------------------------------------------------------- */

/*
 * A keyed jagged tensor (TorchRec's KeyedJaggedTensor) with one batch size for every key.
 *
 *   lengths[f * batch_size + b]  ids of feature f in sample b (feature-major: all B lengths of
 *                                feature 0 first), int32, each >= 0
 *   values[num_values]           the ids, int64, in the order of lengths
 *   weights[num_values]          optional per-id weights (NULL when the batch is unweighted)
 *
 * num_values must equal the sum of lengths; consumers check that before they read values.
 * keys name the features in order; inside the service they are resolved once to feature
 * indices of the layout, and kernels only ever see indices.
 */
struct embd_kjt {
	uint32_t num_features;          /* F */
	uint32_t batch_size;            /* B, TorchRec's stride */
	const char *const *keys;        /* F names; may be NULL where features are implied */
	const int32_t *lengths;         /* F * B */
	const int64_t *values;          /* num_values */
	const float *weights;           /* num_values or NULL */
	uint64_t num_values;
};

/*
 * Layout of a pooled output (TorchRec's KeyedTensor): a row-major float[batch_size][total_dim];
 * feature f occupies columns [feature_offsets[f], feature_offsets[f] + feature_dims[f]), in key
 * order, each feature's columns contiguous.
 */
struct embd_pooled_layout {
	uint32_t num_features;
	uint32_t batch_size;
	uint32_t total_dim;
	const uint32_t *feature_dims;
	const uint32_t *feature_offsets;
};

#ifdef __cplusplus
}
#endif

#endif /* EMBD_TYPES_H */
