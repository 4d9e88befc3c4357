/*
 * Which variant of the CPU kernels runs: the best instruction set that both this build and
 * this CPU have, capped by $EMBD_ISA (so one machine can run and measure a smaller machine's
 * path), unless the caller forces one (tests run every supported variant against the scalar
 * definition). Also the error helper the kernels share.
 */
#include "kernels/cpu_kernels.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef EMBD_KERNELS_X86
#include <cpuid.h>

/* F16C is CPUID.1:ECX bit 29; __builtin_cpu_supports does not name it in every compiler. */
static bool cpu_has_f16c(void)
{
	unsigned a, b, c, d;

	return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}
#endif

/* The best isa of this build and CPU, found by asking the CPU. */
static enum embd_isa detect_best(void)
{
#ifdef EMBD_KERNELS_X86
	__builtin_cpu_init();
	if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !cpu_has_f16c())
		return EMBD_ISA_SCALAR;
	if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	    __builtin_cpu_supports("avx512vl"))
		return EMBD_ISA_AVX512;
	return EMBD_ISA_AVX2;
#else
	return EMBD_ISA_SCALAR;
#endif
}

int embd_kernels_isa_parse(const char *name, enum embd_isa *out)
{
	static const enum embd_isa all[] = { EMBD_ISA_AUTO, EMBD_ISA_SCALAR, EMBD_ISA_AVX2,
					     EMBD_ISA_AVX512 };

	for (size_t i = 0; name && i < sizeof(all) / sizeof(all[0]); i++)
		if (!strcmp(name, embd_kernels_isa_name(all[i]))) {
			*out = all[i];
			return 0;
		}
	return EMBD_EINVAL;
}

enum embd_isa embd_kernels_isa_capped(enum embd_isa detected, const char *cap)
{
	enum embd_isa want;

	if (!cap || embd_kernels_isa_parse(cap, &want) || want == EMBD_ISA_AUTO)
		return detected;
	return want < detected ? want : detected;
}

/*
 * The answer is cached: CPUID traps to the hypervisor in a VM, 13 us each on the dev VMs, and
 * every kernel call picks its isa, so two CPUIDs per call were a quarter of a 2048-bag P=1
 * forward. Threads that race here compute the same value; 0 means not asked yet.
 */
static _Atomic int best_isa;

enum embd_isa embd_kernels_isa_best(void)
{
	int isa = atomic_load_explicit(&best_isa, memory_order_relaxed);

	if (!isa) {
		isa = (int)embd_kernels_isa_capped(detect_best(), getenv("EMBD_ISA"));
		atomic_store_explicit(&best_isa, isa, memory_order_relaxed);
	}
	return (enum embd_isa)isa;
}

/* Cached as best_isa is: 1 Intel, 2 any other vendor, 0 not asked yet; $EMBD_CPU_VENDOR
 * (intel or other) takes that vendor's rules instead of the CPU's. */
static _Atomic int cpu_vendor;

static bool cpu_is_intel(void)
{
	int v = atomic_load_explicit(&cpu_vendor, memory_order_relaxed);

	if (!v) {
		/* tests and benchmarks take either vendor's rules on any CPU */
		const char *force = getenv("EMBD_CPU_VENDOR");

		if (force && !strcmp(force, "intel"))
			v = 1;
		else if (force && !strcmp(force, "other"))
			v = 2;
		else {
#ifdef EMBD_KERNELS_X86
			__builtin_cpu_init();
			v = __builtin_cpu_is("intel") ? 1 : 2;
#else
			v = 2;
#endif
		}
		atomic_store_explicit(&cpu_vendor, v, memory_order_relaxed);
	}
	return v == 1;
}

uint32_t embd_forward_prefetch_distance(uint64_t row_bytes, uint32_t elem_bytes)
{
	return embd_forward_prefetch_rows(row_bytes, elem_bytes, cpu_is_intel());
}

bool embd_forward_prefetch_near(enum embd_isa isa, uint64_t row_bytes, uint32_t elem_bytes)
{
	return embd_forward_prefetch_l1_near(isa, row_bytes, elem_bytes, cpu_is_intel());
}

uint32_t embd_backward_prefetch_distance(uint64_t row_bytes)
{
	return embd_backward_prefetch_rows(row_bytes, cpu_is_intel());
}

bool embd_backward_prefetch_l1(enum embd_optimizer_type type)
{
	return embd_backward_prefetch_l1_near(type);
}

/* Each isa includes the ones below it (AVX-512 here implies AVX2, FMA and F16C). */
bool embd_kernels_isa_supported(enum embd_isa isa)
{
	switch (isa) {
	case EMBD_ISA_AUTO:
	case EMBD_ISA_SCALAR:
	case EMBD_ISA_AVX2:
	case EMBD_ISA_AVX512:
		return isa <= embd_kernels_isa_best();
	default:
		return false;
	}
}

const char *embd_kernels_isa_name(enum embd_isa isa)
{
	switch (isa) {
	case EMBD_ISA_AUTO: return "auto";
	case EMBD_ISA_SCALAR: return "scalar";
	case EMBD_ISA_AVX2: return "avx2";
	case EMBD_ISA_AVX512: return "avx512";
	default: return "unknown";
	}
}

const struct embd_cpu_kernels *embd_cpu_kernels_get(enum embd_isa isa)
{
	if (isa == EMBD_ISA_AUTO)
		isa = embd_kernels_isa_best();
	if (!embd_kernels_isa_supported(isa))
		return NULL;
	switch (isa) {
#ifdef EMBD_KERNELS_X86
	case EMBD_ISA_AVX512: return &embd_cpu_kernels_avx512;
	case EMBD_ISA_AVX2: return &embd_cpu_kernels_avx2;
#endif
	default: return &embd_cpu_kernels_scalar;
	}
}

int embd_kernel_fail(struct embd_kernel_err *err, int code, uint32_t feature, int64_t sample,
		     int64_t id, const char *fmt, ...)
{
	va_list ap;

	if (!err)
		return code;
	err->feature = feature;
	err->sample = sample;
	err->id = id;
	va_start(ap, fmt);
	vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
	va_end(ap);
	return code;
}

void embd_first_err_note(struct embd_first_err *f, int rc, uint32_t batch,
			 const struct embd_kernel_err *e)
{
	if (!rc)
		return;
	if (f->rc && (f->batch < batch || (f->batch == batch && f->e.sample <= e->sample)))
		return;
	f->rc = rc;
	f->batch = batch;
	f->e = *e;
}
