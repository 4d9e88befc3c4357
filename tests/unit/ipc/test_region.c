/*
 * Tests for ipc/region.h: create, attach from the fd, seals (a client cannot shrink or grow
 * the memfd), header checks, and rings shared between the two sides.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ipc/protocol.h"
#include "ipc/region.h"

static const struct embd_region_params params = { .sq_entries = 16, .cq_entries = 16, .slab_bytes = 100000 };

Test(region, create_attach_and_exchange)
{
	struct embd_region *svc = NULL, *cli = NULL;
	struct embd_sqe sqe = { .opcode = EMBD_OP_NOP, .user_data = 77 }, got;
	char err[256] = "";
	int fd;

	cr_assert_eq(embd_region_create(&svc, &params, "test", err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_region_slab_bytes(svc) % 4096, 0, "slab rounded to pages");
	cr_assert_geq(embd_region_slab_bytes(svc), params.slab_bytes);
	fd = dup(embd_region_fd(svc));
	cr_assert_eq(embd_region_attach(&cli, fd, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_region_bytes(cli), embd_region_bytes(svc));
	cr_assert_eq(embd_ring_push(embd_region_sq(cli), &sqe), 0);
	cr_assert_eq(embd_ring_pop(embd_region_sq(svc), &got), 0);
	cr_assert_eq(got.user_data, 77u, "expected user_data 77, got %lu", (unsigned long)got.user_data);
	((char *)embd_region_slab(cli))[10] = 'x';
	cr_assert_eq(((char *)embd_region_slab(svc))[10], 'x', "slab is shared");
	embd_region_destroy(cli);
	embd_region_destroy(svc);
	embd_region_destroy(NULL);
}

Test(region, sealed_against_resize)
{
	struct embd_region *svc = NULL;
	char err[256] = "";

	cr_assert_eq(embd_region_create(&svc, &params, NULL, err, sizeof(err)), 0, "%s", err);
	int fd = embd_region_fd(svc);
	cr_assert_neq(ftruncate(fd, 4096), 0, "a client must not shrink the region");
	cr_assert_eq(errno, EPERM, "expected EPERM, got %d", errno);
	cr_assert_neq(ftruncate(fd, (off_t)embd_region_bytes(svc) * 2), 0, "nor grow it");
	cr_assert_neq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0, "nor change the seals");
	embd_region_destroy(svc);
}

Test(region, attach_refuses_unsealed_and_bad_header)
{
	struct embd_region *cli = NULL;
	char err[256] = "";
	int fd = memfd_create("plain", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	cr_assert_eq(ftruncate(fd, 1 << 20), 0);
	cr_assert_eq(embd_region_attach(&cli, fd, err, sizeof(err)), EMBD_EPROTO);
	cr_assert(strstr(err, "seals"), "expected an error about seals, got \"%s\"", err);
	cr_assert_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
	cr_assert_eq(embd_region_attach(&cli, fd, err, sizeof(err)), EMBD_EPROTO);
	cr_assert(strstr(err, "region.magic"), "expected region.magic, got \"%s\"", err);
	close(fd);
	cr_assert_eq(embd_region_create(&cli, &(struct embd_region_params){ 3, 16, 4096 }, NULL, err,
					sizeof(err)), EMBD_EINVAL);
	cr_assert(strstr(err, "sq_entries"), "got \"%s\"", err);
}
