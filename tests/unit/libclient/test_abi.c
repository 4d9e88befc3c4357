/*
 * The ABI of libembdclient.so.0 (LP64): the sizes and offsets of the structs that a client
 * built earlier has compiled in. A change here breaks those clients: append fields only to
 * structs the library allocates (embd_client_layout), or bump the SOVERSION and the package
 * name (libembdclient0) together, then update these numbers.
 */
#include <criterion/criterion.h>
#include <stddef.h>

#include "embd/client.h"

#define EXPECT_SIZE(type, n) \
	cr_expect_eq(sizeof(struct type), (size_t)(n), #type ": %zu bytes, the ABI has %d", \
		     sizeof(struct type), (n))
#define EXPECT_OFFSET(type, field, n) \
	cr_expect_eq(offsetof(struct type, field), (size_t)(n), #type "." #field \
		     ": offset %zu, the ABI has %d", offsetof(struct type, field), (n))

Test(abi, structs_clients_allocate_or_index_keep_their_layout)
{
	/* arrays the library hands out: clients index them with the size they compiled */
	EXPECT_SIZE(embd_client_table, 80);
	EXPECT_SIZE(embd_client_feature, 76);
	/* structs clients allocate and pass in */
	EXPECT_SIZE(embd_batch, 40);
	EXPECT_SIZE(embd_request, 48);
	EXPECT_OFFSET(embd_request, user_data, 32);
	EXPECT_OFFSET(embd_request, batch_size, 40);
	EXPECT_SIZE(embd_completion, 24);
	EXPECT_SIZE(embd_table_info, 32);
	EXPECT_SIZE(embd_device_outputs, 48);
	EXPECT_OFFSET(embd_device_outputs, pooled, 16);
	EXPECT_OFFSET(embd_device_outputs, grad, 32);
}

Test(abi, the_layout_only_grows_at_its_end)
{
	EXPECT_OFFSET(embd_client_layout, tables, 40);
	EXPECT_OFFSET(embd_client_layout, features, 48);
	EXPECT_OFFSET(embd_client_layout, table_data_types, 56);
}
