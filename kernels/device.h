/*
 * kernels/device.h - what lets one header of per-row arithmetic compile for both the CPU
 * (gcc, clang) and the GPU (nvcc): the EMBD_HOST_DEVICE marker and fp16 <-> fp32 conversion.
 *
 * The conversions are IEEE binary16 with round-to-nearest-even, written as bit manipulation on
 * uint16_t so that they give the same bits as F16C's vcvtph2ps / vcvtps2ph and CUDA's
 * __half2float / __float2half_rn; the CPU vector code and the CUDA code are tested against
 * these scalar functions.
 */
#ifndef EMBD_KERNELS_DEVICE_H
#define EMBD_KERNELS_DEVICE_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define EMBD_HOST_DEVICE __host__ __device__
#else
#define EMBD_HOST_DEVICE
#endif

/* Row pointers of one call never overlap; saying so lets compilers vectorize the row loops. */
#ifdef __cplusplus
#define EMBD_RESTRICT __restrict__
#else
#define EMBD_RESTRICT restrict
#endif

static inline EMBD_HOST_DEVICE uint32_t embd_f32_bits(float f)
{
#ifdef __CUDA_ARCH__
	return __float_as_uint(f);
#else
	uint32_t u;
	memcpy(&u, &f, sizeof(u));
	return u;
#endif
}

static inline EMBD_HOST_DEVICE float embd_bits_f32(uint32_t u)
{
#ifdef __CUDA_ARCH__
	return __uint_as_float(u);
#else
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
#endif
}

/*
 * Non-zero when x is NaN or infinite: an exponent of all ones, (bits & 0x7f800000) +
 * 0x00800000 carries into bit 31 exactly then. Integer AND, ADD and OR with no branch, so
 * that a loop ORing it over an array vectorizes (kernels/finite.h, kernels/optim_row.h).
 */
static inline EMBD_HOST_DEVICE uint32_t embd_nonfinite_bit(float x)
{
	return ((embd_f32_bits(x) & 0x7f800000u) + 0x00800000u) & 0x80000000u;
}

/* Exact: every binary16 value is a binary32 value. A NaN stays a NaN (quieted). */
static inline EMBD_HOST_DEVICE float embd_fp16_to_fp32(uint16_t h)
{
#ifdef __CUDA_ARCH__
	return __half2float(__ushort_as_half(h));
#else
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t exp = (h >> 10) & 0x1fu;
	uint32_t mant = h & 0x3ffu;

	if (exp == 0x1f) {
		/* inf, or NaN with its payload and the quiet bit set */
		if (mant)
			mant |= 0x200u;
		return embd_bits_f32(sign | 0x7f800000u | (mant << 13));
	}
	if (exp == 0) {
		if (!mant)
			return embd_bits_f32(sign);
		/* subnormal: normalize; the value is mant * 2^-24 */
		uint32_t e = 113;
		while (!(mant & 0x400u)) {
			mant <<= 1;
			e--;
		}
		return embd_bits_f32(sign | (e << 23) | ((mant & 0x3ffu) << 13));
	}
	return embd_bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
#endif
}

/* Round to nearest, ties to even; overflow gives inf, as vcvtps2ph with imm8 = 0 does. */
static inline EMBD_HOST_DEVICE uint16_t embd_fp32_to_fp16(float f)
{
#ifdef __CUDA_ARCH__
	return __half_as_ushort(__float2half_rn(f));
#else
	uint32_t x = embd_f32_bits(f);
	uint32_t sign = (x >> 16) & 0x8000u;
	uint32_t ax = x & 0x7fffffffu;

	if (ax >= 0x7f800000u) /* inf, or NaN: keep the top payload bits and quiet it */
		return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));
	if (ax >= 0x477ff000u) /* >= 65520 rounds past the largest finite half, 65504 */
		return (uint16_t)(sign | 0x7c00u);
	if (ax < 0x38800000u) {
		/* below 2^-14: a half subnormal, mant_h * 2^-24; 2^-25 and less round to zero */
		if (ax <= 0x33000000u)
			return (uint16_t)sign;
		uint32_t e = ax >> 23;
		uint32_t m = (ax & 0x7fffffu) | 0x800000u;
		uint32_t shift = 126 - e;
		uint32_t mh = m >> shift;
		uint32_t rem = m & ((1u << shift) - 1);
		uint32_t half = 1u << (shift - 1);
		if (rem > half || (rem == half && (mh & 1)))
			mh++; /* may carry into the smallest normal, which is the right encoding */
		return (uint16_t)(sign | mh);
	}
	uint32_t h = (ax >> 13) - (112u << 10);
	uint32_t rem = ax & 0x1fffu;
	if (rem > 0x1000u || (rem == 0x1000u && (h & 1)))
		h++; /* a carry out of the mantissa bumps the exponent, as it should */
	return (uint16_t)(sign | h);
#endif
}

#endif /* EMBD_KERNELS_DEVICE_H */
