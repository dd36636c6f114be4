# Stand-in for redis:7.2 (deploy/standin/make-images.sh): Debian bookworm's redis-server (7.0, ACL selectors
# included) and redis-cli; docker-entrypoint.sh drops to the redis user as the official image's does.
ARG BASE=tlt-standin/debian:bookworm
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
