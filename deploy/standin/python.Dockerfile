# Stand-in for python:3.11-slim (deploy/standin/make-images.sh): Debian bookworm's Python 3.11, venv and pip.
ARG BASE=tlt-standin/debian:bookworm
FROM ${BASE}
ENV LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends python3 python3-venv python3-pip python-is-python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED
CMD ["python3"]
