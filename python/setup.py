"""Builds embd._client, the C extension over libembdclient (include/embd/client.h).

Where libembdclient comes from, first match wins:
  EMBD_BUILD_DIR   a CMake build folder of embd: the library from <build>/libclient, the
                   header from the source tree that build was configured from
  pkg-config       an installed embd (`cmake --install`): `pkg-config embdclient`
The extension records the library's folder as its run path, so it loads without
LD_LIBRARY_PATH; rebuild it (pip install again) after the library moves.
"""
import os
import re
import shlex
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def from_build_dir(build: str) -> dict:
    cache = os.path.join(build, "CMakeCache.txt")
    try:
        with open(cache, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SystemExit(f"EMBD_BUILD_DIR={build}: cannot read {cache} ({e.strerror}); "
                         "configure and build embd there first") from None
    m = re.search(r"^embd_SOURCE_DIR:STATIC=(.*)$", text, re.M)
    if not m:
        raise SystemExit(f"EMBD_BUILD_DIR={build}: {cache} is not a build of embd "
                         "(no embd_SOURCE_DIR)")
    libdir = os.path.join(build, "libclient")
    if not os.path.exists(os.path.join(libdir, "libembdclient.so")):
        raise SystemExit(f"EMBD_BUILD_DIR={build}: {libdir}/libembdclient.so is missing; "
                         "build the target embdclient first")
    return {"include_dirs": [os.path.join(m.group(1), "include")], "library_dirs": [libdir],
            "runtime_library_dirs": [libdir], "libraries": ["embdclient"]}


def from_pkg_config() -> dict:
    try:
        cflags = subprocess.run(["pkg-config", "--cflags-only-I", "embdclient"], check=True,
                                capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs-only-L", "embdclient"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit("libembdclient not found: set EMBD_BUILD_DIR to a build of embd, or "
                         "install embd so that `pkg-config embdclient` finds it") from None
    libdirs = [a[2:] for a in shlex.split(libs) if a.startswith("-L")]
    return {"include_dirs": [a[2:] for a in shlex.split(cflags) if a.startswith("-I")],
            "library_dirs": libdirs, "runtime_library_dirs": libdirs,
            "libraries": ["embdclient"]}


build_dir = os.environ.get("EMBD_BUILD_DIR")
where = from_build_dir(os.path.abspath(build_dir)) if build_dir else from_pkg_config()

class always_build_ext(build_ext):
    """Compiles every time: an up-to-date check looks at _client.c only, not at client.h or at
    which libembdclient (and run path) this build links, so a stale object could outlive a
    change of the client's structs. The compile takes about a second."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.force = True


# The test command sets EMBD_WERROR=1, as it builds the C code with warnings as errors.
flags = ["-std=c11", "-Wall", "-Wextra"] + (["-Werror"] if os.environ.get("EMBD_WERROR") else [])
setup(ext_modules=[Extension("embd._client", sources=["src/embd/_client.c"],
                             extra_compile_args=flags, **where)],
      cmdclass={"build_ext": always_build_ext})
