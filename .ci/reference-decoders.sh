#!/usr/bin/env bash
# Reference decoders for the decode benchmarks and tests: torchcodec (links the system's FFmpeg
# shared libraries) and decord2 (the maintained fork of decord, its own FFmpeg bundled). Installs
# into the active virtualenv:
#
#     . .venv/bin/activate && bash .ci/reference-decoders.sh
#
# Idempotent: apt-get runs only when no complete set of FFmpeg libraries torchcodec can use is
# present, pip only when the pinned versions are not installed; with both in place it takes
# about 0.1 s (the import check then runs only with REFERENCE_DECODERS_CHECK=1). From scratch on Debian 12 (bookworm): ~10 s of apt (93 packages, FFmpeg 5.1)
# plus a few seconds of pip.
#
# Versions (torch 2.13.0+cpu, Python 3.11, x86-64):
# - torchcodec 0.13.0: the newest *CPU* build on PyPI; works with torch 2.13.0+cpu and FFmpeg 4-8.
#   PyPI's 0.14.0-0.17.0 wheels are CUDA 13 builds: they link libnvrtc.so.13, libcudart.so.13,
#   libc10_cuda.so and libtorch_cuda.so and fail to import next to a CPU torch ("OSError:
#   libnvrtc.so.13: cannot open shared object file"). CPU builds of those live only on
#   download.pytorch.org/whl/cpu (TORCHCODEC_INDEX below, for machines that can reach it).
# - decord2 3.4.0 (manylinux_2_28 wheel, CPU): the maintained fork of decord, whose last release
#   (0.6.0) is from 2021. Both install the module `decord`, so an old `decord` is removed first.
set -euo pipefail

TORCHCODEC_VERSION=${TORCHCODEC_VERSION:-0.13.0}
DECORD_VERSION=${DECORD_VERSION:-3.4.0}      # of decord2
TORCHCODEC_INDEX=${TORCHCODEC_INDEX:-}     # e.g. https://download.pytorch.org/whl/cpu for torchcodec>=0.14

PY=${PYTHON:-python}
if ! "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
    echo "reference-decoders: activate the project's virtualenv first (. .venv/bin/activate)" >&2
    exit 1
fi

# --- FFmpeg shared libraries (torchcodec tries FFmpeg 8, 7, 6, 5, 4 and needs all seven of one) ---
declare -A FFMPEG_SONAMES=(
    [8]="libavutil.so.60 libavcodec.so.62 libavformat.so.62 libavdevice.so.62 libavfilter.so.11 libswscale.so.9 libswresample.so.6"
    [7]="libavutil.so.59 libavcodec.so.61 libavformat.so.61 libavdevice.so.61 libavfilter.so.10 libswscale.so.8 libswresample.so.5"
    [6]="libavutil.so.58 libavcodec.so.60 libavformat.so.60 libavdevice.so.60 libavfilter.so.9 libswscale.so.7 libswresample.so.4"
    [5]="libavutil.so.57 libavcodec.so.59 libavformat.so.59 libavdevice.so.59 libavfilter.so.8 libswscale.so.6 libswresample.so.4"
    [4]="libavutil.so.56 libavcodec.so.58 libavformat.so.58 libavdevice.so.58 libavfilter.so.7 libswscale.so.5 libswresample.so.3"
)
ffmpeg_present() {
    local names major lib ok
    names=$( (ldconfig -p 2>/dev/null || /sbin/ldconfig -p) | awk 'NR > 1 {print $1}')
    for major in 8 7 6 5 4; do
        ok=1
        for lib in ${FFMPEG_SONAMES[$major]}; do
            grep -qxF "$lib" <<<"$names" || { ok=0; break; }
        done
        if [ "$ok" = 1 ]; then echo "$major"; return 0; fi
    done
    return 1
}

changed=0
if major=$(ffmpeg_present); then
    echo "reference-decoders: FFmpeg $major shared libraries present"
else
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    echo "reference-decoders: installing FFmpeg shared libraries with apt-get"
    $SUDO apt-get update -qq
    # libavdevice pulls in the other six (libavfilter -> libswscale, libswresample, libpostproc;
    # libavformat, libavcodec, libavutil): bookworm's libavdevice59 = FFmpeg 5.1, 93 packages.
    pkg=""
    for v in 62 61 60 59 58; do
        if apt-cache show "libavdevice$v" >/dev/null 2>&1; then pkg="libavdevice$v"; break; fi
    done
    [ -n "$pkg" ] || { echo "reference-decoders: no libavdevice58-62 package in apt" >&2; exit 1; }
    $SUDO apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null
    major=$(ffmpeg_present) || { echo "reference-decoders: $pkg installed but the FFmpeg libraries are incomplete" >&2; exit 1; }
    echo "reference-decoders: installed $pkg (FFmpeg $major)"
    changed=1
fi

# --- pinned wheels into the active virtualenv ---
installed() {  # prints the installed version of $1, or nothing
    "$PY" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}
want=()
[ "$(installed torchcodec)" = "$TORCHCODEC_VERSION" ] || want+=("torchcodec==$TORCHCODEC_VERSION")
[ "$(installed decord2)" = "$DECORD_VERSION" ] || want+=("decord2==$DECORD_VERSION")
if [ -n "$(installed decord)" ]; then      # the unmaintained package of the same module
    echo "reference-decoders: pip uninstall decord $(installed decord) (decord2 replaces it)"
    "$PY" -m pip uninstall -q -y decord
    [ -n "$(installed decord2)" ] && want+=("decord2==$DECORD_VERSION" --force-reinstall --no-deps)
    changed=1
fi
if [ ${#want[@]} -gt 0 ]; then
    echo "reference-decoders: pip install ${want[*]}"
    extra=()
    [ -z "$TORCHCODEC_INDEX" ] || extra=(--extra-index-url "$TORCHCODEC_INDEX")
    "$PY" -m pip install -q --disable-pip-version-check ${extra[@]+"${extra[@]}"} "${want[@]}"
    changed=1
fi

# --- check after a change (or with REFERENCE_DECODERS_CHECK=1; it costs ~3 s of torch import):
# both import and torchcodec found its FFmpeg ---
if [ "$changed" = 0 ] && [ "${REFERENCE_DECODERS_CHECK:-0}" != 1 ]; then
    echo "reference-decoders: torchcodec $TORCHCODEC_VERSION and decord2 $DECORD_VERSION already installed"
    exit 0
fi
"$PY" - <<'EOF'
import decord
import torchcodec
from torchcodec.decoders import VideoDecoder  # noqa: F401
print(f"reference-decoders: torchcodec {torchcodec.__version__} (FFmpeg {torchcodec.ffmpeg_major_version}), "
      f"decord2 {decord.__version__}")
EOF
