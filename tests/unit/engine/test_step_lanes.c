/*
 * Tests for engine/step_lanes.c's split of a node message over the comm's lanes: both ends cut
 * the same parts from the size they agree on, the parts tile the message in lane order, every
 * part but the last is whole 64-byte blocks, and no lane gets more than one block more than
 * another. (The transfers themselves run in every cluster test: tests/integration/.)
 */
#include <criterion/criterion.h>

#include "engine/step_internal.h"

Test(step_lanes, parts_tile_the_message)
{
	const uint64_t sizes[] = { 0, 1, 63, 64, 65, 160, 1000, 4096, 4097, 123457, 1u << 20 };
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		for (uint32_t lanes = 1; lanes <= 9; lanes++) {
			uint64_t at = 0, most = 0, least = UINT64_MAX;
			for (uint32_t l = 0; l < lanes; l++) {
				uint64_t off, len;
				step_lane_part(sizes[i], lanes, l, &off, &len);
				cr_assert_eq(off, at, "bytes %llu lanes %u: lane %u starts at %llu, "
					     "expected %llu", (unsigned long long)sizes[i], lanes, l,
					     (unsigned long long)off, (unsigned long long)at);
				cr_assert(off + len == sizes[i] || len % 64 == 0,
					  "bytes %llu lanes %u: lane %u has %llu bytes",
					  (unsigned long long)sizes[i], lanes, l, (unsigned long long)len);
				at += len;
				uint64_t blocks = (len + 63) / 64;
				most = blocks > most ? blocks : most;
				least = blocks < least ? blocks : least;
			}
			cr_assert_eq(at, sizes[i], "bytes %llu lanes %u: parts cover %llu",
				     (unsigned long long)sizes[i], lanes, (unsigned long long)at);
			cr_assert(most - least <= 1, "bytes %llu lanes %u: %llu to %llu blocks per lane",
				  (unsigned long long)sizes[i], lanes, (unsigned long long)least,
				  (unsigned long long)most);
		}
	}
	/* a HELLO head (160 bytes) over 2 lanes: both carry a part, so the CPU tests move bytes
	 * on every lane */
	uint64_t off, len;
	step_lane_part(160, 2, 1, &off, &len);
	cr_assert(len > 0, "lane 1 of a 160-byte message is empty");
}
