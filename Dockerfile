# dtlab in a container. CPU by default:
#   docker build -t dtlab:cpu .
#   docker run --rm dtlab:cpu train --set train.steps=20
# CUDA (the wheels bundle CUDA; the host needs only the NVIDIA driver and the container toolkit):
#   docker build -t dtlab:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   docker run --rm --gpus all --ipc=host dtlab:cuda train configs/fsdp.yaml --nproc 8
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the chosen index: a plain `pip install dtlab` would pull the default (CUDA) build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/dtlab
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip install ".[data]"
COPY configs ./configs
COPY deploy/run.sh /usr/local/bin/dtlab-run

# Runs (metrics, checkpoints) go to /runs: mount a volume there to keep them.
RUN useradd --create-home --uid 1000 dtlab && mkdir -p /runs && chown dtlab /runs
USER dtlab
WORKDIR /runs
ENTRYPOINT ["dtlab"]
CMD ["--help"]
