# One image for every tlt-stream service (compose.yaml starts each role from it with its own entrypoint).
# The default torch wheel is a CUDA build; for a CPU image (what compose.cpu.yaml sets):
#   --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
FROM python:3.11-slim
ARG TORCH_SPEC="torch>=2.5,<2.15"
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN pip install ${TORCH_SPEC}
COPY pyproject.toml README.md ./
COPY tlt_stream ./tlt_stream
COPY services ./services
RUN pip install ".${EXTRAS}"
# The runtime user owns /data, so the named volume mounted there (seeded from the image) is writable.
RUN useradd --create-home --uid 1000 tlt && mkdir -p /data && chown tlt:tlt /data
USER tlt
ENV HOME=/home/tlt MPLCONFIGDIR=/home/tlt/.cache/matplotlib
ENTRYPOINT ["tlt-stream"]
CMD ["--help"]
