#!/bin/sh
# Extract Mooncake's system libraries (libibverbs.so.1, libnl-3.so.200, libnl-route-3.so.200) into
# DEST without root: `apt-get download` the Debian packages and unpack them with `dpkg-deb -x`.
# Nothing is done when the system already has libibverbs or DEST already holds it.
# sparsekv finds DEST=<venv>/sysroot by itself; for another DEST set SPARSEKV_MOONCAKE_LIBDIR=DEST.
#
# example:
#   tools/fetch_mooncake_libs.sh .venv/sysroot
set -eu
if [ $# -ne 1 ]; then
    echo "usage: $0 DEST   (example: $0 .venv/sysroot)" >&2
    exit 2
fi
DEST=$1
PY=${PYTHON:-python3}
if "$PY" -c 'import ctypes; ctypes.CDLL("libibverbs.so.1")' 2>/dev/null; then
    echo "libibverbs.so.1 is on the system; nothing to fetch"
    exit 0
fi
if [ -n "$(find "$DEST" -name libibverbs.so.1 2>/dev/null)" ]; then
    echo "libibverbs.so.1 is already in $DEST"
    exit 0
fi
for tool in apt-get dpkg-deb; do
    command -v "$tool" >/dev/null || { echo "$0: needs $tool (Debian/Ubuntu)" >&2; exit 1; }
done
WORK=$(mktemp -d)
chmod 755 "$WORK"  # apt-get downloads as its unprivileged _apt user where it can
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200)
mkdir -p "$DEST"
for deb in "$WORK"/*.deb; do
    dpkg-deb -x "$deb" "$DEST"
done
echo "extracted $(cd "$WORK" && ls ./*.deb | tr '\n' ' ')into $DEST"
