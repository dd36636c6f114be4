# One image for every tlt-stream service. On a GPU host the default torch wheel is a CUDA build; pass
# --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" for a CPU image.
FROM python:3.11-slim
ARG TORCH_SPEC="torch>=2.5,<2.15"
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
RUN pip install ${TORCH_SPEC}
COPY pyproject.toml README.md ./
COPY tlt_stream ./tlt_stream
COPY services ./services
RUN pip install ".${EXTRAS}"
USER 1000:1000
ENTRYPOINT ["tlt-stream"]
CMD ["--help"]
