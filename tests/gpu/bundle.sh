#!/bin/bash
# tests/gpu/bundle.sh BUILD OUT - the service's programs from the build folder BUILD with the
# shared libraries they load, under OUT, so tests/gpu/run.sh runs them on a lent GPU machine
# that has the CUDA toolkit and driver but none of the Debian packages (liburing, libnuma,
# Gloo, cJSON, libsystemd, libmicrohttpd, criterion, ...) and no network.
#   OUT/bin: embd, embctl, embd-demo-trainer, test_integration_training, test_integration_dist,
#            test_device_outputs where BUILD has CUDA (it links the CUDA runtime), and
#            embd-bench unless BUILD is a sanitizer build (its figures would mean nothing, and
#            it would take the bundle over the limit)
#   OUT/lib: every library ldd names for them, but the C library's own (libc, libm, libdl,
#            libpthread, librt, the loader), the GPU driver's (libcuda, libnvidia-*) and the
#            CUDA toolkit's (libcudart, libnccl: the GPU machine's own match its driver)
# Run them with LD_LIBRARY_PATH=OUT/lib (run.sh does). Exit 1 when a library cannot be found
# or OUT is larger than 64 MiB (EMBD_BUNDLE_MAX_BYTES), the most a lent machine is handed.
set -euo pipefail
if [ $# -ne 2 ]; then
	echo "usage: $0 BUILD OUT" >&2
	exit 2
fi
build=$1 out=$2
max_bytes=${EMBD_BUNDLE_MAX_BYTES:-$((64 << 20))}
programs=(daemon/embd tools/embctl/embctl tools/demo/embd-demo-trainer
	  tests/integration/test_integration_training tests/integration/test_integration_dist)
benchmarks=(tools/bench/embd-bench)

# built only where CUDA is
optional=(tests/test_device_outputs)

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for p in "${programs[@]}"; do
	if [ ! -x "$build/$p" ]; then
		echo "bundle: $build/$p is not built" >&2
		exit 1
	fi
	cp "$build/$p" "$out/bin/"
done
for p in "${benchmarks[@]}"; do
	if [ ! -x "$build/$p" ]; then
		echo "bundle: $build/$p is not built" >&2
		exit 1
	fi
	if bash "$(dirname "$0")/sanitized.sh" "$build/$p"; then
		echo "bundle: $p left out: a sanitizer build"
		continue
	fi
	cp "$build/$p" "$out/bin/"
	programs+=("$p")
done
for p in "${optional[@]}"; do
	if [ -x "$build/$p" ]; then
		cp "$build/$p" "$out/bin/"
		programs+=("$p")
	fi
done

# one "name path" line per library; "not found" fails unless it is one the GPU machine brings
missing=0
while read -r name arrow path _; do
	case "$name" in
	libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|*ld-linux*|linux-vdso*) continue ;;
	libcuda.so*|libnvidia-*|libcudart.so*|libnccl.so*) continue ;;
	esac
	if [ "$arrow" != "=>" ] || [ "$path" = "not" ]; then
		echo "bundle: $name: not found" >&2
		missing=1
		continue
	fi
	cp -L "$path" "$out/lib/$name"
done < <(ldd "$out"/bin/* | grep -v ':$' | awk '{print $1, $2, $3}' | sort -u)
[ "$missing" = 0 ] || exit 1
# debug info is no use on the GPU machine and doubles a sanitizer build's bundle
if command -v strip >/dev/null; then
	strip --strip-debug "$out"/bin/* "$out"/lib/* 2>/dev/null || true
fi

bytes=$(du -sb "$out" | cut -f1)
echo "bundle: $out: ${#programs[@]} programs, $(ls "$out/lib" | wc -l) libraries, $bytes bytes"
if [ "$bytes" -gt "$max_bytes" ]; then
	echo "bundle: $bytes bytes is over the $max_bytes a GPU machine is handed" >&2
	exit 1
fi
