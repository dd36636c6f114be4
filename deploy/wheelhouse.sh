#!/usr/bin/env bash
# Fills a wheelhouse for an offline image build (`make wheelhouse`; the Dockerfile's WHEELHOUSE argument) from
# this host's pip: whatever index, find-links and cache its configuration names. Wheels only, for this host's
# Python and platform, which must be the image's.
#
#   deploy/wheelhouse.sh DIR PYTHON TORCH_SPEC [PIP OPTION...]
# Reuses what DIR holds; prints nothing but pip's errors. The project's own wheel is not kept (the image builds
# it from its source, with the setuptools wheel kept here). The image's Python may be an older 3.11 than this
# host's: dependencies its markers add there are listed below.
set -euo pipefail
dir=$1 python=$2 torch=$3
shift 3
cd "$(dirname "$0")/.."
want=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case $want in
3.11) ;;
*) echo "wheelhouse: $python is Python $want; the image's Python is 3.11 (set WHEEL_PYTHON)" >&2 ;;
esac
mkdir -p "$dir"
# async-timeout: redis-py needs it below Python 3.11.3 (Debian bookworm's python3 is 3.11.2), a marker this host's
# newer 3.11 does not meet.
"$python" -m pip wheel -q --wheel-dir "$dir" --find-links "$dir" "$@" "$torch" . "setuptools>=77" wheel \
    "async-timeout>=4.0.3" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
rm -f "$dir"/tlt_stream-*.whl
echo "wheelhouse: $(ls "$dir" | wc -l) wheels, $(du -sh "$dir" | cut -f 1) in $dir"
