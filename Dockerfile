# One image for every tlt-stream service (compose.yaml starts each role from it with its own entrypoint).
# The default torch wheel is a CUDA build; for a CPU image (what compose.cpu.yaml sets):
#   --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# Offline (an air-gapped host): `make wheelhouse` fills ./wheelhouse from the host's pip, then
#   --build-arg WHEELHOUSE=wheelhouse        pip installs from it only (no index is asked)
# (compose.cpu.yaml passes TLT_WHEELHOUSE and TLT_BASE_IMAGE from the shell or .env as these arguments).
# BASE_IMAGE: another Python 3.11+ image with venv (e.g. a local mirror's copy, or deploy/standin's).
ARG BASE_IMAGE=python:3.11-slim

# The environment is built in its own stage, so a wheelhouse never becomes a layer of the image.
FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC="torch>=2.5,<2.15"
ARG EXTRAS=""
ARG WHEELHOUSE=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tlt-stream
# Without a wheelhouse this copies one small file that nothing reads.
COPY ${WHEELHOUSE:-pyproject.toml} /wheelhouse/
RUN if [ -n "${WHEELHOUSE}" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; fi \
    && /opt/tlt-stream/bin/pip install ${TORCH_SPEC}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY tlt_stream ./tlt_stream
COPY services ./services
RUN if [ -n "${WHEELHOUSE}" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; fi \
    && /opt/tlt-stream/bin/pip install ".${EXTRAS}"

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PATH=/opt/tlt-stream/bin:$PATH
COPY --from=build /opt/tlt-stream /opt/tlt-stream
# The runtime user owns /data, so the named volume mounted there (seeded from the image) is writable.
RUN useradd --create-home --uid 1000 tlt && mkdir -p /data && chown tlt:tlt /data
USER tlt
WORKDIR /home/tlt
ENV HOME=/home/tlt MPLCONFIGDIR=/home/tlt/.cache/matplotlib
ENTRYPOINT ["tlt-stream"]
CMD ["--help"]
