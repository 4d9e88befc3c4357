/*
 * Integration: live table access (embd_table_*) against real embd nodes (dist_fixture.h; one
 * node is a cluster of one). After training, the rows and the optimizer state read through a
 * trainer's handle equal the unsharded reference's; rows written are exactly what the next
 * forward pools; a whole state (weights and optimizer state) read from one service and
 * written into a fresh one makes both train the same step alike (state_dict / load_state_dict);
 * a table larger than one message goes in chunks; refusals are named and leave the
 * connection up; on a cluster a node reads the rows it holds, names the node of the others,
 * and refuses writes.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "embd/client.h"
#include "kernels/embedding.h"
#include "tests/integration/dist_fixture.h"

TestSuite(tables, .fini = stop_cluster, .timeout = 60);

/* Starts node n's paths as a service of its own, one trainer, with tables_json (NULL: the
 * tests' two tables, planner's choice of sharding), and waits for its socket. */
static void spawn_alone(uint32_t n, const char *tables_json)
{
	node_paths(n);
	FILE *f = fopen(nodes[n].config, "w");
	cr_assert_not_null(f, "cannot write %s", nodes[n].config);
	fprintf(f, "{ ");
	if (tables_json)
		fprintf(f, "%s", tables_json);
	else
		write_tables(f, NULL);
	fprintf(f, ", \"topology\": {\"world_size\": 2, \"local_world_size\": 2, "
		"\"compute_device\": \"cpu\", \"batch_size\": %d}, \"trainers_per_node\": 1, "
		"\"seed\": %u, \"threads_per_rank\": 1, \"busy_poll_us\": 20 }\n", BATCH, SEED);
	fclose(f);
	if (num_nodes < n + 1)
		num_nodes = n + 1;
	spawn(n);
	tu_embd_await_socket(&nodes[n].embd, 15000, "a service alone");
}

static struct embd_client *connect_trainer(uint32_t node, uint32_t index)
{
	struct embd_client *c;
	char err[256];

	cr_assert_eq(embd_connect(nodes[node].embd.socket, (int)index, 5000, &c, err, sizeof(err)),
		     0, "node %u trainer %u: %s", node, index, err);
	return c;
}

/* Reads array a of table t through c and compares it with the reference's. */
static void expect_table(struct embd_client *c, uint32_t t, enum embd_table_array a,
			 const struct embd_ref_table *ref, const char *what)
{
	static float got[64 * 8];
	struct embd_table_info info;
	uint64_t applied;

	cr_assert_eq(embd_table_info(c, t, a, &info), 0, "%s: %s", what, embd_last_error(c));
	cr_assert_eq(info.cols, tables[t].dim, "%s: table %u array %d: %u columns", what, t, a,
		     info.cols);
	cr_assert_eq(embd_table_read(c, t, a, 0, (uint64_t)tables[t].rows, got, &applied), 0,
		     "%s: %s", what, embd_last_error(c));
	for (int64_t r = 0; r < tables[t].rows; r++)
		for (uint32_t col = 0; col < info.cols; col++) {
			float want = a == EMBD_TABLE_WEIGHTS ? embd_ref_weight(ref, r, col)
							     : ref->m1[r * info.cols + col];
			float v = got[r * info.cols + col];
			cr_assert(close_enough(want, v), "%s: table %u array %d row %lld col %u: "
				  "expected %.9g, got %.9g", what, t, a, (long long)r, col, want, v);
		}
}

/* Trains K steps with RANKS trainers on one node of sharding, then reads every table and
 * t_mean's adagrad state through a new trainer's handle: they equal the reference. */
static void read_after_training(const char *sharding)
{
	const char *sockets[1];
	struct embd_ref_table *ref[NUM_TABLES];

	start_cluster(1, sharding);
	struct shared *sh = shared_map();
	sockets[0] = nodes[0].embd.socket;
	run_trainers(sh, RANKS, sockets, RANKS);
	check_against_reference_keep(sh, RANKS, sharding, 0, ref);
	struct embd_client *c = connect_trainer(0, 0);
	uint64_t applied = 0;
	float row[8];
	cr_assert_eq(embd_table_read(c, 0, EMBD_TABLE_WEIGHTS, 0, 1, row, &applied), 0);
	cr_expect_eq(applied, K_STEPS, "applied_step: expected %d, got %llu", K_STEPS,
		     (unsigned long long)applied);
	for (uint32_t t = 0; t < NUM_TABLES; t++)
		expect_table(c, t, EMBD_TABLE_WEIGHTS, ref[t], sharding);
	expect_table(c, 1, EMBD_TABLE_MOMENTUM1, ref[1], sharding);
	embd_close(c);
	for (uint32_t t = 0; t < NUM_TABLES; t++)
		embd_ref_table_destroy(ref[t]);
	munmap(sh, sizeof(*sh));
}

Test(tables, read_after_training_row_wise) { read_after_training("row_wise"); }
Test(tables, read_after_training_column_wise) { read_after_training("column_wise"); }
Test(tables, read_after_training_data_parallel) { read_after_training("data_parallel"); }

/* Pools one bag of the single id `row` of feature f (table 0 or 1) through c as step `step`:
 * out gets the feature's columns of sample 0; the backward's gradient is 0.5 on them, so the
 * row and its optimizer state move. */
static void pool_one(struct embd_client *c, uint32_t f, int64_t row, uint64_t step, float *out)
{
	const struct embd_client_layout *l = embd_layout(c);
	struct embd_batch b;

	embd_batch_get(c, 0, &b);
	memset(b.lengths, 0, (size_t)l->num_features * l->batch_size * sizeof(int32_t));
	b.lengths[f * l->batch_size] = 1;
	b.values[0] = row;
	cr_assert_eq(embd_forward(c, 0, step, 1, 0), 0, "%s", embd_last_error(c));
	memcpy(out, b.pooled + l->features[f].offset, l->features[f].dim * sizeof(float));
	memset(b.grad, 0, (size_t)l->batch_size * l->total_dim * sizeof(float));
	for (uint32_t col = 0; col < l->features[f].dim; col++)
		b.grad[l->features[f].offset + col] = 0.5f;
	cr_assert_eq(embd_backward(c, 0, step, 1, 0), 0, "%s", embd_last_error(c));
}

/* Rows written (by ids and as a range) are what the next forward pools, bit for bit, on every
 * sharding; refusals are named and the handle keeps working. */
static void write_then_pool(const char *sharding)
{
	float rows[3 * 8], got[8];

	dist_trainers_per_node = 1;
	start_cluster(1, sharding);
	struct embd_client *c = connect_trainer(0, 0);
	uint64_t s = embd_layout(c)->resumed_step;
	int64_t ids[3] = { 63, 5, 0 };
	for (uint32_t i = 0; i < 3 * 8; i++)
		rows[i] = 0.125f * (float)i - 1.0f;
	cr_assert_eq(embd_table_write_ids(c, 0, EMBD_TABLE_WEIGHTS, ids, 3, rows), 0, "%s",
		     embd_last_error(c));
	cr_assert_eq(embd_table_write(c, 1, EMBD_TABLE_WEIGHTS, 38, 2, rows + 8), 0, "%s",
		     embd_last_error(c));
	for (uint32_t i = 0; i < 3; i++) {
		pool_one(c, 0, ids[i], s++, got);
		cr_expect(!memcmp(got, rows + 8 * i, 8 * sizeof(float)), "%s: feature f_a of row "
			  "%lld: pooled %.9g ..., written %.9g ...", sharding, (long long)ids[i],
			  got[0], rows[8 * i]);
	}
	pool_one(c, 2, 39, s++, got);   /* t_mean, a bag of one: the row itself */
	cr_expect(!memcmp(got, rows + 16, 8 * sizeof(float)), "%s: f_c of row 39: pooled %.9g, "
		  "written %.9g", sharding, got[0], rows[16]);

	/* refusals, each named, the handle still usable after them */
	cr_expect_eq(embd_table_read(c, 2, EMBD_TABLE_WEIGHTS, 0, 1, got, NULL), EMBD_ENOENT);
	cr_expect(strstr(embd_last_error(c), "2 tables"), "got '%s'", embd_last_error(c));
	cr_expect_eq(embd_table_read(c, 0, EMBD_TABLE_WEIGHTS, 60, 5, rows, NULL), EMBD_ERANGE);
	cr_expect(strstr(embd_last_error(c), "row 64 outside table 't_sum'"), "got '%s'",
		  embd_last_error(c));
	cr_expect_eq(embd_table_read(c, 1, EMBD_TABLE_MOMENTUM2, 0, 1, rows, NULL), EMBD_EINVAL);
	cr_expect(strstr(embd_last_error(c), "no such state"), "adagrad keeps no momentum2: got "
		  "'%s'", embd_last_error(c));
	rows[3] = NAN;
	cr_expect_eq(embd_table_write(c, 0, EMBD_TABLE_WEIGHTS, 1, 1, rows), EMBD_EINVAL);
	cr_expect(strstr(embd_last_error(c), "not a finite value"), "got '%s'", embd_last_error(c));
	pool_one(c, 0, 1, s++, got);
	cr_expect(!isnan(got[3]), "a refused write changed the row");
	embd_close(c);
}

Test(tables, written_rows_are_pooled_table_wise) { write_then_pool("table_wise"); }
Test(tables, written_rows_are_pooled_row_wise) { write_then_pool("row_wise"); }
Test(tables, written_rows_are_pooled_table_column_wise) { write_then_pool("table_column_wise"); }
Test(tables, written_rows_are_pooled_data_parallel) { write_then_pool("data_parallel"); }

/* Every row and state of both tables read from the node in use and written into a second,
 * fresh service of another sharding: one step of the same batch on both pools and trains
 * alike (state_dict, then load_state_dict into a new model). */
Test(tables, state_round_trip_into_a_fresh_service)
{
	static float w[2][64 * 8], m1[40 * 8], out[2][8];
	struct embd_client *c[2];

	dist_trainers_per_node = 1;
	start_cluster(1, "row_wise");
	c[0] = connect_trainer(0, 0);
	uint64_t s = embd_layout(c[0])->resumed_step;
	pool_one(c[0], 2, 7, s++, out[0]);      /* one step, so the adagrad state is not 0 */
	for (uint32_t t = 0; t < NUM_TABLES; t++)
		cr_assert_eq(embd_table_read(c[0], t, EMBD_TABLE_WEIGHTS, 0, (uint64_t)tables[t].rows,
					     w[t], NULL), 0, "%s", embd_last_error(c[0]));
	cr_assert_eq(embd_table_read(c[0], 1, EMBD_TABLE_MOMENTUM1, 0, 40, m1, NULL), 0);
	/* the second service, on node 1's paths, sharded as its planner likes */
	spawn_alone(1, NULL);
	c[1] = connect_trainer(1, 0);
	for (uint32_t t = 0; t < NUM_TABLES; t++)
		cr_assert_eq(embd_table_write(c[1], t, EMBD_TABLE_WEIGHTS, 0, (uint64_t)tables[t].rows,
					      w[t]), 0, "%s", embd_last_error(c[1]));
	cr_assert_eq(embd_table_write(c[1], 1, EMBD_TABLE_MOMENTUM1, 0, 40, m1), 0, "%s",
		     embd_last_error(c[1]));
	uint64_t s1 = embd_layout(c[1])->resumed_step;
	for (uint32_t k = 0; k < 2; k++) {
		pool_one(c[0], 2, 7, s++, out[0]);
		pool_one(c[1], 2, 7, s1++, out[1]);
		cr_expect(!memcmp(out[0], out[1], sizeof(out[0])), "step %u after the round trip: "
			  "%.9g on the first service, %.9g on the second", k, out[0][0], out[1][0]);
	}
	embd_close(c[0]);
	embd_close(c[1]);
}

/* A table of 20000 x 16 (1.25 MB, 11 messages of 1820 rows) written whole and read back whole
 * and by ids across the chunk boundaries. */
Test(tables, large_table_in_chunks)
{
	const int64_t R = 20000;
	const uint32_t D = 16;
	float *in = malloc((size_t)R * D * sizeof(float)), *back = malloc((size_t)R * D * sizeof(float));
	struct embd_table_info info;

	char tables_json[256];

	cr_assert(in && back);
	snprintf(tables_json, sizeof(tables_json), "\"tables\": [{\"name\": \"big\", "
		 "\"num_embeddings\": %lld, \"embedding_dim\": %u, \"feature_names\": [\"f\"], "
		 "\"optimizer\": {\"type\": \"sgd\", \"lr\": 0.1}}]", (long long)R, D);
	port = tu_free_port();
	spawn_alone(0, tables_json);
	struct embd_client *c = connect_trainer(0, 0);
	cr_assert_eq(embd_table_info(c, 0, EMBD_TABLE_WEIGHTS, &info), 0, "%s", embd_last_error(c));
	cr_expect(info.num_embeddings == R && info.cols == D && info.max_rows == 131072 / (8 + 4 * D),
		  "info: %lld rows of %u, %u a message", (long long)info.num_embeddings, info.cols,
		  info.max_rows);
	cr_assert_eq(embd_table_read(c, 0, EMBD_TABLE_WEIGHTS, 0, (uint64_t)R, back, NULL), 0, "%s",
		     embd_last_error(c));
	for (int64_t r = 0; r < R; r += 997)
		cr_assert_eq(back[r * D + 3], embd_init_value(SEED, 0, R, r, 3),
			     "row %lld: not the initial value", (long long)r);
	for (uint64_t i = 0; i < (uint64_t)R * D; i++)
		in[i] = (float)(i % 1001) / 1000.0f;
	cr_assert_eq(embd_table_write(c, 0, EMBD_TABLE_WEIGHTS, 0, (uint64_t)R, in), 0, "%s",
		     embd_last_error(c));
	memset(back, 0, (size_t)R * D * sizeof(float));
	cr_assert_eq(embd_table_read(c, 0, EMBD_TABLE_WEIGHTS, 0, (uint64_t)R, back, NULL), 0);
	cr_expect(!memcmp(in, back, (size_t)R * D * sizeof(float)), "the table read back differs");
	static int64_t ids[4000];
	for (uint32_t i = 0; i < 4000; i++)
		ids[i] = (int64_t)((i * 7919u) % (uint32_t)R);
	cr_assert_eq(embd_table_read_ids(c, 0, EMBD_TABLE_WEIGHTS, ids, 4000, back, NULL), 0);
	for (uint32_t i = 0; i < 4000; i++)
		cr_assert(!memcmp(&back[i * D], &in[ids[i] * D], D * sizeof(float)), "ids[%u] = %lld "
			  "read back differs", i, (long long)ids[i]);
	embd_close(c);
	free(in);
	free(back);
}

/* Two nodes, row_wise (table 0's rows spread over every rank): node 0 reads the rows it holds,
 * names node 1 for the others, and refuses writes. */
Test(tables, cluster_reads_local_rows_and_refuses_writes)
{
	float row[8];

	start_cluster(2, "row_wise");
	struct embd_client *c = connect_trainer(0, 0);
	cr_expect_eq(embd_table_read(c, 0, EMBD_TABLE_WEIGHTS, 0, 1, row, NULL), 0, "%s",
		     embd_last_error(c));
	cr_expect_eq(row[2], embd_init_value(SEED, 0, tables[0].rows, 0, 2));
	cr_expect_eq(embd_table_read(c, 0, EMBD_TABLE_WEIGHTS, tables[0].rows - 1, 1, row, NULL),
		     EMBD_ENOENT);
	cr_expect(strstr(embd_last_error(c), "on node 1"), "got '%s'", embd_last_error(c));
	cr_expect_eq(embd_table_write(c, 0, EMBD_TABLE_WEIGHTS, 0, 1, row), EMBD_ENOTSUP);
	cr_expect(strstr(embd_last_error(c), "cluster"), "got '%s'", embd_last_error(c));
	embd_close(c);
}
