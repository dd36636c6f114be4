# Stand-in for eclipse-mosquitto:2 (deploy/standin/make-images.sh): Debian bookworm's mosquitto (2.0, with
# mosquitto_passwd) and mosquitto-clients; /docker-entrypoint.sh as the official image's.
ARG BASE=tlt-standin/debian:bookworm
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends mosquitto mosquitto-clients \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /mosquitto/config /mosquitto/data /mosquitto/log \
    && chown -R mosquitto:mosquitto /mosquitto
COPY mosquitto-entrypoint.sh /docker-entrypoint.sh
EXPOSE 1883
ENTRYPOINT ["/docker-entrypoint.sh"]
CMD ["/usr/sbin/mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]
