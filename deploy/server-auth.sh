#!/bin/sh
# The entry point of compose.yaml's two servers: writes their credentials from the environment, then runs the
# rest of the command line (the image's own entry point and the server).
#
#   server-auth.sh redis COMMAND...      users.acl from redis-users.acl (each `>${VAR}` becomes `#` and the
#                                        sha256 of $VAR, `#${RANDOM_HASH}` a random sha256); runs COMMAND
#                                        --aclfile DIR/users.acl
#   server-auth.sh mosquitto COMMAND...  passwd (`mosquitto_passwd -b`, one user per role from
#                                        TLT_MQTT_PASSWORD_<ROLE>) and acl (a copy of mosquitto.acl), the files
#                                        mosquitto.conf names; runs COMMAND
#
# DIR is $TLT_AUTH_DIR (/run/tlt-auth), readable by the server's user only. A password that is unset, empty,
# still a `change-me` placeholder of .env.example, or holds a character a URL would need escaped (compose puts
# the passwords into the services' URLs as they are) stops the server with one line naming the variable.
set -eu

here=$(dirname "$0")
dir=${TLT_AUTH_DIR:-/run/tlt-auth}
server=${1:-}
ROLES="policy rollout learner monitor"

fail() {
    echo "tlt-stream $server: $*" >&2
    exit 1
}

password() { # the value of the environment variable named $1, checked
    case $1 in '' | [0-9]* | *[!A-Za-z0-9_]*) fail "not a variable name: '$1'" ;; esac
    eval "value=\${$1-}"
    case $value in
    '') fail "$1 is unset or empty: set the passwords in .env (sh deploy/make-env.sh writes one)" ;;
    change-me*) fail "$1 still holds the placeholder of .env.example: set a password of your own" ;;
    *[!A-Za-z0-9._~-]*) fail "$1 may hold only letters, digits and - . _ ~ (it goes into a URL unescaped)" ;;
    esac
    printf '%s' "$value"
}

write_redis_acl() {
    rules=$(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$here/redis-users.acl")
    edits=""
    for name in $(printf '%s\n' "$rules" | grep -o '>\${[A-Za-z_][A-Za-z0-9_]*}' | sed 's/^>\${//; s/}$//' | sort -u); do
        secret=$(password "$name")
        hash=$(printf '%s' "$secret" | sha256sum | cut -d ' ' -f 1)
        edits="$edits s/>\${$name}/#$hash/g;"
    done
    # the default user's password: a random hash, whose preimage exists nowhere (redis-users.acl says why)
    random=$(head -c 32 /dev/urandom | sha256sum | cut -d ' ' -f 1)
    edits="$edits s/#\${RANDOM_HASH}/#$random/g;"
    printf '%s\n' "$rules" | sed "$edits" >"$dir/users.acl.new"
    if grep -q '\${' "$dir/users.acl.new"; then
        fail "redis-users.acl holds a placeholder that is not >\${NAME}"
    fi
    mv "$dir/users.acl.new" "$dir/users.acl"
}

write_mosquitto_auth() {
    : >"$dir/passwd.new"
    for role in $ROLES; do
        secret=$(password "TLT_MQTT_PASSWORD_$(printf '%s' "$role" | tr 'a-z' 'A-Z')")
        mosquitto_passwd -b "$dir/passwd.new" "$role" "$secret"
    done
    mv "$dir/passwd.new" "$dir/passwd"
    cp "$here/mosquitto.acl" "$dir/acl"
}

[ $# -ge 2 ] || fail "usage: server-auth.sh redis|mosquitto COMMAND..."
shift
umask 077
mkdir -p "$dir"
case $server in
redis)
    write_redis_acl
    set -- "$@" --aclfile "$dir/users.acl"
    owner=redis
    ;;
mosquitto)
    write_mosquitto_auth
    owner=mosquitto
    ;;
*) fail "unknown server (redis or mosquitto)" ;;
esac
if [ "$(id -u)" = 0 ] && id "$owner" >/dev/null 2>&1; then
    chown -R "$owner" "$dir" # the server runs as this user (the image drops root)
fi
exec "$@"
