#!/bin/sh
# The stand-in eclipse-mosquitto:2's entry point: as the official image's, /mosquitto belongs to the mosquitto
# user (the broker drops to it after reading its configuration as root).
set -e
if [ "$(id -u)" = 0 ] && [ -d /mosquitto ]; then
    chown -R mosquitto:mosquitto /mosquitto || true
fi
exec "$@"
