/*
 * CRC-32C (ckpt/crc32c.h). The table path is slice-by-8 over the reflected polynomial
 * 0x82f63b78; the hardware path runs three independent crc32q streams over thirds of each
 * large block (the instruction's latency is 3 cycles, its throughput 1) and combines them by
 * shifting with a zero-extension table built at first use. The choice between the two is made
 * once from cpuid, so the result never depends on which path ran.
 */
#include "ckpt/crc32c.h"

#include <pthread.h>
#include <string.h>

#define POLY 0x82f63b78u

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void table_init(void)
{
	for (uint32_t n = 0; n < 256; n++) {
		uint32_t c = n;
		for (int k = 0; k < 8; k++)
			c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
		table[0][n] = c;
	}
	for (uint32_t n = 0; n < 256; n++)
		for (int k = 1; k < 8; k++)
			table[k][n] = (table[k - 1][n] >> 8) ^ table[0][table[k - 1][n] & 0xff];
}

static uint32_t table_update(uint32_t c, const uint8_t *p, size_t len)
{
	while (len && ((uintptr_t)p & 7)) {
		c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
		len--;
	}
	while (len >= 8) {
		uint64_t w;
		memcpy(&w, p, 8);
		w ^= c;
		c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
		    table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^
		    table[2][(w >> 40) & 0xff] ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
		p += 8;
		len -= 8;
	}
	while (len--)
		c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
	return c;
}

uint32_t embd_crc32c_table(uint32_t crc, const void *data, size_t len)
{
	pthread_once(&table_once, table_init);
	return ~table_update(~crc, data, len);
}

#if defined(__x86_64__)

/* Multiplies a (a polynomial mod POLY, reflected) by b: the shift that combines streams. */
static uint32_t gf_mul(uint32_t a, uint32_t b)
{
	uint32_t prod = 0;
	for (int i = 0; i < 32; i++) {
		if (b & 0x80000000u)
			prod ^= a;
		b <<= 1;
		a = a & 1 ? (a >> 1) ^ POLY : a >> 1;
	}
	return prod;
}

/* x^(8 * n) mod POLY, reflected: what appending n zero bytes multiplies a crc by. */
static uint32_t zeros_factor(size_t n)
{
	uint32_t result = 0x80000000u, sq = 0x00800000u;       /* x^0, x^8 */
	while (n) {
		if (n & 1)
			result = gf_mul(result, sq);
		sq = gf_mul(sq, sq);
		n >>= 1;
	}
	return result;
}

#define BLOCK 8192u                     /* bytes per stream per round (3 streams) */
static uint32_t shift_block;             /* zeros_factor(BLOCK) */
static pthread_once_t hw_once = PTHREAD_ONCE_INIT;
static bool have_hw;

static void hw_init(void)
{
	__builtin_cpu_init();
	have_hw = __builtin_cpu_supports("sse4.2");
	shift_block = zeros_factor(BLOCK);
}

__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t c, const uint8_t *p,
							  size_t len)
{
	uint64_t c0 = c;

	while (len && ((uintptr_t)p & 7)) {
		c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
		len--;
	}
	while (len >= 3 * BLOCK) {
		uint64_t c1 = 0, c2 = 0;
		for (size_t i = 0; i < BLOCK; i += 8) {
			uint64_t a, b, d;
			memcpy(&a, p + i, 8);
			memcpy(&b, p + BLOCK + i, 8);
			memcpy(&d, p + 2 * BLOCK + i, 8);
			c0 = __builtin_ia32_crc32di(c0, a);
			c1 = __builtin_ia32_crc32di(c1, b);
			c2 = __builtin_ia32_crc32di(c2, d);
		}
		/* reg(A|B) = reg(A) * x^(8|B|) ^ reg0(B), reg0 starting from 0 (CRC is linear) */
		c0 = gf_mul((uint32_t)c0, shift_block) ^ (uint32_t)c1;
		c0 = gf_mul((uint32_t)c0, shift_block) ^ (uint32_t)c2;
		p += 3 * BLOCK;
		len -= 3 * BLOCK;
	}
	while (len >= 8) {
		uint64_t a;
		memcpy(&a, p, 8);
		c0 = __builtin_ia32_crc32di(c0, a);
		p += 8;
		len -= 8;
	}
	while (len--)
		c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
	return (uint32_t)c0;
}

bool embd_crc32c_hw(void)
{
	pthread_once(&hw_once, hw_init);
	return have_hw;
}

uint32_t embd_crc32c(uint32_t crc, const void *data, size_t len)
{
	if (embd_crc32c_hw())
		return ~hw_update(~crc, data, len);
	return embd_crc32c_table(crc, data, len);
}

#else

bool embd_crc32c_hw(void)
{
	return false;
}

uint32_t embd_crc32c(uint32_t crc, const void *data, size_t len)
{
	return embd_crc32c_table(crc, data, len);
}

#endif
