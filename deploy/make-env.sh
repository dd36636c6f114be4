#!/bin/sh
# Writes the compose stack's .env: .env.example with a fresh random password (32 hex digits) in place of each
# change-me placeholder, readable by its owner only. Refuses to overwrite an existing file.
#
#   sh deploy/make-env.sh [PATH]        PATH: .env beside compose.yaml
set -eu

root=$(dirname "$0")/..
out=${1:-$root/.env}
if [ -e "$out" ]; then
    echo "make-env: $out exists; remove it first to replace its passwords" >&2
    exit 1
fi
umask 077
while IFS= read -r line || [ -n "$line" ]; do
    case $line in
    TLT_*=change-me*) printf '%s=%s\n' "${line%%=*}" "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" ;;
    *) printf '%s\n' "$line" ;;
    esac
done <"$root/.env.example" >"$out.new"
mv "$out.new" "$out"
echo "make-env: wrote $out" >&2
