/*
 * The service config parser (daemon/config.h): the embedded default parses and plans, every
 * key is read into its field, and every error names the key it is about (unknown keys, wrong
 * types, out-of-range values, duplicates, the planner's own table and topology errors).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "daemon/config.h"

static int parse(const char *text, struct embd_config *c, char *err, size_t err_len)
{
	return embd_config_parse(text, strlen(text), c, err, err_len);
}

Test(config, default_parses_and_plans)
{
	struct embd_config c;
	struct embd_plan *plan = NULL;
	char err[256] = "";

	int rc = parse(embd_config_default_text(), &c, err, sizeof(err));
	cr_assert_eq(rc, 0, "default config: expected 0, got %d: %s", rc, err);
	cr_assert_eq(c.tables.count, 4, "expected the 4 demo tables, got %u", c.tables.count);
	cr_assert_eq(c.topology.local_world_size, 2);
	cr_assert_eq(c.topology.compute_device, EMBD_DEVICE_CPU);
	cr_assert_eq(c.trainers_per_node, 2);
	cr_assert_str_eq(c.socket_path, EMBD_CONFIG_DEFAULT_SOCKET);
	cr_assert_eq(c.num_allowed_uids, 1);
	cr_assert_eq(c.allowed_uids[0], getuid());
	cr_assert_eq(c.num_allowed_gids, 0);
	cr_assert_eq(c.handshake_timeout_ms, 5000);
	cr_assert_eq(c.step_wait_warn_ms, 10000);
	cr_assert_eq(c.step_wait_abort_ms, 0);
	rc = embd_plan_build(c.tables.specs, c.tables.constraints, c.tables.count, &c.topology, NULL,
			     &plan, err, sizeof(err));
	cr_assert_eq(rc, 0, "planning the default: %d %s", rc, err);
	embd_plan_destroy(plan);
	embd_config_free(&c);
}

Test(config, every_key_is_read)
{
	const char *text =
		"{ \"tables\": [ { \"name\": \"t\", \"num_embeddings\": 10, \"embedding_dim\": 4 } ],"
		"  \"topology\": { \"world_size\": 1, \"compute_device\": \"cpu\", \"batch_size\": 8 },"
		"  \"plan_file\": \"/tmp/p.json\", \"socket_path\": \"/tmp/x.sock\","
		"  \"allowed_uids\": [1, 2], \"allowed_gids\": [7], \"trainers_per_node\": 3,"
		"  \"seed\": 12345678901, \"threads_per_rank\": 2, \"log_level\": \"debug\","
		"  \"checkpoint_dir\": \"/tmp/ck\", \"busy_poll_us\": 0,"
		"  \"checkpoint_every_steps\": 100, \"checkpoint_every_seconds\": 600,"
		"  \"checkpoint_keep\": 0, \"checkpoint_layout\": \"per_node\","
		"  \"checkpoint_allow_fresh_start\": true,"
		"  \"handshake_timeout_ms\": 250, \"step_wait_warn_ms\": 0,"
		"  \"step_wait_abort_ms\": 60000, \"gradient_scaling\": \"sum\","
		"  \"metrics_listen\": \"[::1]:9464\" }";
	struct embd_config c;
	char err[256] = "";

	int rc = parse(text, &c, err, sizeof(err));
	cr_assert_eq(rc, 0, "expected 0, got %d: %s", rc, err);
	cr_assert_eq(c.tables.count, 1);
	cr_assert_eq(c.topology.batch_size, 8);
	cr_assert_str_eq(c.plan_file, "/tmp/p.json");
	cr_assert_str_eq(c.socket_path, "/tmp/x.sock");
	cr_assert_eq(c.num_allowed_uids, 2);
	cr_assert_eq(c.allowed_uids[1], 2);
	cr_assert_eq(c.num_allowed_gids, 1);
	cr_assert_eq(c.allowed_gids[0], 7);
	cr_assert_eq(c.trainers_per_node, 3);
	cr_assert_eq(c.seed, 12345678901ull);
	cr_assert_eq(c.threads_per_rank, 2);
	cr_assert_eq(c.log_level, EMBD_LOG_DEBUG);
	cr_assert_str_eq(c.checkpoint_dir, "/tmp/ck");
	cr_assert_eq(c.busy_poll_us, 0);
	cr_assert_eq(c.checkpoint_every_steps, 100);
	cr_assert_eq(c.checkpoint_every_seconds, 600);
	cr_assert_eq(c.checkpoint_keep, 0);
	cr_assert_eq(c.checkpoint_layout, EMBD_CKPT_PER_NODE);
	cr_assert_eq(c.gradient_scaling, EMBD_GRADIENT_SUM);
	cr_assert_eq(embd_config_grad_divisor(&c), 1);
	cr_assert(c.checkpoint_allow_fresh_start);
	cr_assert_eq(c.handshake_timeout_ms, 250);
	cr_assert_eq(c.step_wait_warn_ms, 0);
	cr_assert_eq(c.step_wait_abort_ms, 60000);
	cr_assert_str_eq(c.metrics_listen, "[::1]:9464");
	embd_config_free(&c);
}

Test(config, defaults_fill_missing_parts)
{
	struct embd_config c;
	char err[256] = "";

	int rc = parse("{ \"socket_path\": \"/tmp/s\" }", &c, err, sizeof(err));
	cr_assert_eq(rc, 0, "%d %s", rc, err);
	cr_assert_eq(c.tables.count, 4);
	cr_assert_eq(c.trainers_per_node, (uint32_t)c.topology.local_world_size);
	cr_assert_eq(c.threads_per_rank, 1);
	cr_assert_eq(c.busy_poll_us, 50);
	cr_assert_str_eq(c.metrics_listen, "", "the endpoint is off by default");
	cr_assert_eq(c.checkpoint_keep, 3);
	cr_assert_eq(c.checkpoint_layout, EMBD_CKPT_SHARED);
	cr_assert(!c.checkpoint_allow_fresh_start, "a fresh start over damage is opt-in");
	cr_assert_eq(c.checkpoint_every_steps, 0);
	/* TorchRec's gradient division by the trainers of the cluster */
	cr_assert_eq(c.gradient_scaling, EMBD_GRADIENT_MEAN_OVER_TRAINERS);
	cr_assert_eq(embd_config_grad_divisor(&c), c.trainers_per_node);
	embd_config_free(&c);
	/* an explicit empty allowed_uids means nobody by uid */
	rc = parse("{ \"allowed_uids\": [], \"allowed_gids\": [5] }", &c, err, sizeof(err));
	cr_assert_eq(rc, 0, "%d %s", rc, err);
	cr_assert_eq(c.num_allowed_uids, 0);
	embd_config_free(&c);
}

/* allowed_uids / allowed_gids take names, resolved when parsed (root and its group exist on
 * every Linux system); an unknown name is refused naming the key and the name. */
Test(config, ids_by_name)
{
	struct embd_config c;
	char err[256] = "";

	int rc = parse("{ \"allowed_uids\": [\"root\", 7], \"allowed_gids\": [9, \"root\"] }", &c,
		       err, sizeof(err));
	cr_assert_eq(rc, 0, "%d %s", rc, err);
	cr_expect_eq(c.num_allowed_uids, 2);
	cr_expect_eq(c.allowed_uids[0], 0, "user root should be uid 0, got %u", c.allowed_uids[0]);
	cr_expect_eq(c.allowed_uids[1], 7);
	cr_expect_eq(c.num_allowed_gids, 2);
	cr_expect_eq(c.allowed_gids[1], 0, "group root should be gid 0, got %u", c.allowed_gids[1]);
	embd_config_free(&c);

	rc = parse("{ \"allowed_gids\": [\"no-such-group-embd-test\"] }", &c, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EINVAL, "expected EMBD_EINVAL, got %d", rc);
	cr_expect(strstr(err, "allowed_gids") && strstr(err, "group 'no-such-group-embd-test'"),
		  "message: %s", err);
	rc = parse("{ \"allowed_uids\": [\"no-such-user-embd-test\"] }", &c, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EINVAL, "expected EMBD_EINVAL, got %d", rc);
	cr_expect(strstr(err, "allowed_uids") && strstr(err, "user 'no-such-user-embd-test'"),
		  "message: %s", err);
}

struct bad_case {
	const char *text;
	const char *needle;      /* what the error must mention */
};

Test(config, errors_name_the_key)
{
	static const struct bad_case cases[] = {
		{ "{ \"sokcet_path\": \"/x\" }", "sokcet_path" },
		{ "{ \"socket_path\": 3 }", "socket_path" },
		{ "{ \"socket_path\": \"\" }", "socket_path" },
		{ "{ \"plan_file\": [] }", "plan_file" },
		{ "{ \"allowed_uids\": 5 }", "allowed_uids" },
		{ "{ \"allowed_uids\": [-1] }", "allowed_uids" },
		{ "{ \"allowed_gids\": [1.5] }", "allowed_gids" },
		{ "{ \"allowed_gids\": [\"a\"] }", "allowed_gids" },
		{ "{ \"trainers_per_node\": 0 }", "trainers_per_node" },
		{ "{ \"trainers_per_node\": \"2\" }", "trainers_per_node" },
		{ "{ \"threads_per_rank\": 2.5 }", "threads_per_rank" },
		{ "{ \"threads_per_rank\": 100000 }", "threads_per_rank" },
		{ "{ \"seed\": -1 }", "seed" },
		{ "{ \"log_level\": \"loud\" }", "log_level" },
		{ "{ \"log_level\": 3 }", "log_level" },
		{ "{ \"checkpoint_dir\": false }", "checkpoint_dir" },
		{ "{ \"checkpoint_layout\": \"nfs\" }", "checkpoint_layout" },
		{ "{ \"busy_poll_us\": -5 }", "busy_poll_us" },
		{ "{ \"handshake_timeout_ms\": 0 }", "handshake_timeout_ms" },
		{ "{ \"step_wait_warn_ms\": -1 }", "step_wait_warn_ms" },
		{ "{ \"step_wait_abort_ms\": 5000 }", "step_wait_abort_ms': 5000 ms must be above" },
		{ "{ \"step_wait_warn_ms\": 100, \"step_wait_abort_ms\": 100 }", "step_wait_abort_ms" },
		{ "{ \"checkpoint_every_steps\": -1 }", "checkpoint_every_steps" },
		{ "{ \"checkpoint_every_seconds\": 1.5 }", "checkpoint_every_seconds" },
		{ "{ \"checkpoint_keep\": \"3\" }", "checkpoint_keep" },
		{ "{ \"gradient_scaling\": \"mean\" }", "gradient_scaling" },
		{ "{ \"gradient_scaling\": 1 }", "gradient_scaling" },
		{ "{ \"checkpoint_allow_fresh_start\": 1 }", "checkpoint_allow_fresh_start" },
		{ "{ \"seed\": 1, \"seed\": 2 }", "seed" },
		{ "{ \"topology\": { \"world_size\": 4, \"local_world_size\": 2, "
		  "\"compute_device\": \"cpu\" }, \"node_rank\": 2 }", "node_rank" },
		{ "{ \"backend\": \"mpi\" }", "backend" },
		{ "{ \"backend\": \"nccl\" }", "'backend': nccl needs compute_device cuda" },
		{ "{ \"master_port\": 70000 }", "master_port" },
		{ "{ \"master_port\": 0 }", "master_port" },
		{ "{ \"master_addr\": \"\" }", "master_addr" },
		{ "{ \"gloo_ifname\": \"\" }", "gloo_ifname" },
		{ "{ \"gloo_ifname\": \"eth0,eth1\" }", "gloo_ifname" },
		{ "{ \"gloo_ifname\": \"a-name-of-16-byte\" }", "gloo_ifname" },
		{ "{ \"gloo_ifname\": 0 }", "gloo_ifname" },
		{ "{ \"comm_addr\": \"node1.example\" }", "comm_addr" },
		{ "{ \"comm_addr\": \"10.0.0.256\" }", "comm_addr" },
		{ "{ \"comm_addr\": \"10.0.0.1\", \"gloo_ifname\": \"eth0\" }", "comm_addr" },
		{ "{ \"collective_timeout_ms\": 0 }", "collective_timeout_ms" },
		{ "{ \"metrics_listen\": \"localhost:9464\" }", "metrics_listen" },
		{ "{ \"metrics_listen\": \"127.0.0.1\" }", "metrics_listen" },
		{ "{ \"metrics_listen\": \"127.0.0.1:0\" }", "metrics_listen" },
		{ "{ \"metrics_listen\": 9464 }", "metrics_listen" },
		{ "{ \"store_timeout_ms\": -1 }", "store_timeout_ms" },
		{ "{ \"topology\": { \"wrold_size\": 2 } }", "wrold_size" },
		{ "{ \"tables\": [ { \"name\": \"t\", \"num_embeddings\": 10 } ] }", "embedding_dim" },
		{ "{ \"tables\": [] }", "tables" },
		{ "{ \"tables\": [ { \"name\": \"a\", \"num_embeddings\": 10, \"embedding_dim\": 4, "
		  "\"feature_names\": [\"clicks\"] }, { \"name\": \"b\", \"num_embeddings\": 10, "
		  "\"embedding_dim\": 4, \"feature_names\": [\"clicks\"] } ] }",
		  "feature 'clicks' is in table 0 ('a') and table 1 ('b')" },
		{ "[1, 2]", "object" },
		{ "{ \"seed\": 1,\n  \"x\" }", "line 2" },
		{ "{ \"seed\": 1 }\n}", "after the JSON value" },
		{ "{ \"allowed_uids\": [] }", "allowed_uids': empty and no allowed_gids" },
		{ "{ \"seed\": 1 }\n{ \"seed\": 2 }", "line 2" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct embd_config c;
		char err[512] = "";
		int rc = parse(cases[i].text, &c, err, sizeof(err));
		cr_expect_lt(rc, 0, "case %zu (%s): expected an error, got %d", i, cases[i].text, rc);
		cr_expect(strstr(err, cases[i].needle) != NULL,
			  "case %zu (%s): expected the error to mention '%s', got '%s'", i,
			  cases[i].text, cases[i].needle, err);
		if (!rc)
			embd_config_free(&c);
	}
}

/* Several nodes: world_size a multiple of local_world_size, the env:// keys, timeouts. */
Test(config, cluster_keys)
{
	struct embd_config c;
	char err[512] = "";
	const char *text = "{ \"topology\": { \"world_size\": 6, \"local_world_size\": 2, "
			   "\"compute_device\": \"cpu\" }, \"master_addr\": \"10.0.0.1\", "
			   "\"master_port\": 29511, \"node_rank\": 2, \"backend\": \"gloo\", "
			   "\"collective_timeout_ms\": 1500, \"gloo_ifname\": \"eth1\" }";
	int rc = parse(text, &c, err, sizeof(err));
	cr_assert_eq(rc, 0, "expected 0, got %d (%s)", rc, err);
	cr_expect_eq(embd_config_nodes(&c), 3u, "nodes: expected 3, got %u", embd_config_nodes(&c));
	cr_expect_str_eq(c.master_addr, "10.0.0.1");
	cr_expect_eq(c.master_port, 29511);
	cr_expect_eq(c.node_rank, 2u);
	cr_expect_eq(c.backend, EMBD_COMM_GLOO);
	cr_expect_eq(c.collective_timeout_ms, 1500);
	cr_expect_str_eq(c.gloo_ifname, "eth1");
	cr_expect_str_eq(c.comm_addr, "");
	cr_expect_eq(c.store_timeout_ms, 1500, "store_timeout_ms 0 means collective_timeout_ms, "
		     "got %d", c.store_timeout_ms);
	cr_expect_eq(embd_config_grad_divisor(&c), 6u, "the gradients of 2 trainers on each of 3 "
		     "nodes: expected a divisor of 6, got %u", embd_config_grad_divisor(&c));
	embd_config_free(&c);
	rc = parse("{ }", &c, err, sizeof(err));
	cr_assert_eq(rc, 0, "%s", err);
	cr_expect_str_eq(c.master_addr, "127.0.0.1");
	cr_expect_eq(c.master_port, 29500);
	cr_expect_eq(embd_config_nodes(&c), 1u);
	cr_expect_str_eq(c.gloo_ifname, "", "gloo_ifname: none by default");
	embd_config_free(&c);
	rc = parse("{ \"comm_addr\": \"fd00::2\" }", &c, err, sizeof(err));
	cr_assert_eq(rc, 0, "%s", err);
	cr_expect_str_eq(c.comm_addr, "fd00::2");
	embd_config_free(&c);	/* GPU nodes exchange over NCCL (the devices are counted at start, not here) */
	rc = parse("{ \"topology\": { \"world_size\": 4, \"local_world_size\": 2, "
		   "\"compute_device\": \"cuda\" }, \"backend\": \"nccl\" }", &c, err, sizeof(err));
	cr_assert_eq(rc, 0, "cuda with nccl: expected 0, got %d (%s)", rc, err);
	cr_expect_eq(c.backend, EMBD_COMM_NCCL);
	embd_config_free(&c);
}

/* The socket's mode lets in what the config allows and no more: SO_PEERCRED checks each
 * peer, but a mode narrower than the config would refuse allowed peers with EACCES first. */
Test(config, socket_mode_follows_the_allowed_ids)
{
	static const struct { const char *ids; mode_t mode; } cases[] = {
		{ "", 0600 },                                           /* the owner alone */
		{ "\"allowed_uids\": [1000]", 0600 },
		{ "\"allowed_uids\": [1000, 0]", 0600 },                /* root passes any mode */
		{ "\"allowed_uids\": [1000, 1001]", 0666 },
		{ "\"allowed_gids\": [100]", 0660 },                    /* the owner and its group */
		{ "\"allowed_gids\": [100, 200]", 0666 },
		{ "\"allowed_uids\": [], \"allowed_gids\": [100]", 0660 },
		{ "\"allowed_uids\": [], \"allowed_gids\": [200]", 0666 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char text[256], err[256] = "";
		struct embd_config c;
		snprintf(text, sizeof(text), "{ %s }", cases[i].ids);
		int rc = parse(text, &c, err, sizeof(err));
		cr_assert_eq(rc, 0, "%s: %s", text, err);
		if (!cases[i].ids[0]) {       /* the default: the parsing process's uid */
			c.allowed_uids[0] = 1000;
		}
		mode_t mode = embd_config_socket_mode(&c, 1000, 100);
		cr_expect_eq(mode, cases[i].mode, "%s for uid 1000 gid 100: expected 0%o, got 0%o",
			     text, cases[i].mode, mode);
		embd_config_free(&c);
	}
}

Test(config, load_names_the_path)
{
	struct embd_config c;
	char err[512] = "";
	char path[] = "/tmp/embd_test_config_XXXXXX";
	int fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	const char *text = "{ \"busy_poll_us\": \"x\" }";
	cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
	close(fd);
	int rc = embd_config_load(path, &c, err, sizeof(err));
	unlink(path);
	cr_assert_eq(rc, EMBD_EINVAL, "expected EMBD_EINVAL, got %d", rc);
	cr_assert(strstr(err, path) && strstr(err, "busy_poll_us"), "got '%s'", err);
	rc = embd_config_load("/nonexistent/embd.conf", &c, err, sizeof(err));
	cr_assert_eq(rc, EMBD_ENOENT, "expected EMBD_ENOENT, got %d", rc);
	cr_assert(strstr(err, "/nonexistent/embd.conf"), "got '%s'", err);
}

/* GPU ranks: the GPU count fills in what the topology left out; more ranks than GPUs refused. */
Test(config, cuda_ranks_default_to_the_gpu_count)
{
	struct embd_config c;
	char err[256] = "";

	cr_assert_eq(parse("{ \"topology\": { \"compute_device\": \"cuda\" } }", &c, err,
			   sizeof(err)), 0, "%s", err);
	cr_assert(!c.local_world_size_given && !c.world_size_given && !c.trainers_per_node_given);
	cr_assert_eq(embd_config_resolve_devices(&c, 4, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(c.topology.local_world_size, 4);
	cr_assert_eq(c.topology.world_size, 4);
	cr_assert_eq(c.trainers_per_node, 4);
	embd_config_free(&c);

	/* two nodes of the GPUs each: world_size given, local_world_size from the count */
	cr_assert_eq(parse("{ \"topology\": { \"world_size\": 8, \"compute_device\": "
			   "\"cuda\" }, \"trainers_per_node\": 1 }", &c, err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(embd_config_resolve_devices(&c, 4, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(c.topology.local_world_size, 4);
	cr_assert_eq(c.topology.world_size, 8);
	cr_assert_eq(c.trainers_per_node, 1, "given, so kept");
	cr_assert_eq(embd_config_nodes(&c), 2);
	embd_config_free(&c);

	cr_assert_eq(parse("{ \"topology\": { \"world_size\": 8, \"local_world_size\": 8, "
			   "\"compute_device\": \"cuda\" } }", &c, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(embd_config_resolve_devices(&c, 2, err, sizeof(err)), EMBD_ENOTSUP);
	cr_assert(strstr(err, "local_world_size 8 asks for more GPUs than the 2"), "got '%s'", err);
	embd_config_free(&c);

	/* cpu: untouched whatever the count */
	cr_assert_eq(parse("{ \"topology\": { \"world_size\": 2, \"compute_device\": "
			   "\"cpu\" } }", &c, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_config_resolve_devices(&c, 0, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(c.topology.local_world_size, 2);
	embd_config_free(&c);
}
