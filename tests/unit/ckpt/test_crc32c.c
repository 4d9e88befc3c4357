/*
 * CRC-32C (ckpt/crc32c.h): the published check values (RFC 3720 B.4 and the "123456789"
 * check), the hardware and table paths equal on every length and alignment around the
 * 3-stream block size, and incremental updates equal one call.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/crc32c.h"

Test(crc32c, known_vectors)
{
	uint8_t buf[48];
	static const uint8_t iscsi_read[48] = {
		0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14,
		0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00,
		0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
	};
	struct vec { const void *p; size_t n; uint32_t want; const char *what; } v[5];

	cr_assert_eq(embd_crc32c(0, "123456789", 9), 0xe3069283u, "check value of '123456789'");
	cr_assert_eq(embd_crc32c_table(0, "123456789", 9), 0xe3069283u);
	memset(buf, 0, 32);
	v[0] = (struct vec){ buf, 32, 0x8a9136aau, "32 zero bytes" };
	uint8_t ff[32], inc[32], dec[32];
	memset(ff, 0xff, 32);
	for (int i = 0; i < 32; i++) {
		inc[i] = (uint8_t)i;
		dec[i] = (uint8_t)(31 - i);
	}
	v[1] = (struct vec){ ff, 32, 0x62a8ab43u, "32 bytes of 0xff" };
	v[2] = (struct vec){ inc, 32, 0x46dd794eu, "0..31" };
	v[3] = (struct vec){ dec, 32, 0x113fdb5cu, "31..0" };
	v[4] = (struct vec){ iscsi_read, 48, 0xd9963a56u, "iSCSI read command" };
	for (int i = 0; i < 5; i++) {
		cr_expect_eq(embd_crc32c(0, v[i].p, v[i].n), v[i].want, "%s: expected %08x, got %08x",
			     v[i].what, v[i].want, embd_crc32c(0, v[i].p, v[i].n));
		cr_expect_eq(embd_crc32c_table(0, v[i].p, v[i].n), v[i].want, "%s (table)", v[i].what);
	}
	cr_expect_eq(embd_crc32c(0, NULL, 0), 0u, "empty input");
}

Test(crc32c, hardware_equals_table_at_every_length_and_alignment)
{
	const size_t max = 3 * 8192 * 2 + 100;
	uint8_t *buf = malloc(max + 8);
	uint64_t s = 12345;

	cr_assert_not_null(buf);
	for (size_t i = 0; i < max + 8; i++) {
		s = s * 6364136223846793005ull + 1;
		buf[i] = (uint8_t)(s >> 56);
	}
	size_t lens[] = { 0, 1, 7, 8, 9, 63, 64, 1000, 8191, 8192, 24575, 24576, 24577, 49152,
			  49153, max };
	for (size_t a = 0; a < 8; a++)
		for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
			uint32_t hw = embd_crc32c(0, buf + a, lens[k]);
			uint32_t tb = embd_crc32c_table(0, buf + a, lens[k]);
			cr_assert_eq(hw, tb, "offset %zu length %zu: table %08x, dispatched (%s) %08x", a,
				     lens[k], tb, embd_crc32c_hw() ? "sse4.2" : "table", hw);
		}
	free(buf);
}

Test(crc32c, incremental_equals_one_call)
{
	uint8_t buf[70000];
	for (size_t i = 0; i < sizeof(buf); i++)
		buf[i] = (uint8_t)(i * 31 + 7);
	uint32_t whole = embd_crc32c(0, buf, sizeof(buf));
	size_t cuts[] = { 1, 13, 4096, 24576, 30000, 69999 };
	for (size_t k = 0; k < sizeof(cuts) / sizeof(cuts[0]); k++) {
		uint32_t c = embd_crc32c(0, buf, cuts[k]);
		c = embd_crc32c(c, buf + cuts[k], sizeof(buf) - cuts[k]);
		cr_expect_eq(c, whole, "split at %zu: expected %08x, got %08x", cuts[k], whole, c);
	}
}
