#!/bin/sh
# The stand-in redis:7.2's entry point: as the official image's, redis-server started as root owns its working
# directory and runs as the redis user.
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
    set -- redis-server "$@"
fi
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
    find . \! -user redis -exec chown redis '{}' +
    exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
