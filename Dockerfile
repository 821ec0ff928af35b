# syntax=docker/dockerfile:1
# gpudet on CUDA 13 + cuDNN 9: onnxruntime-gpu 1.31 and nvidia-dali-cuda130 are CUDA 13 builds
# (NVIDIA driver >= 580 on the host). Run with the video capability for the hardware JPEG decoder:
#   docker run --gpus 'all,"capabilities=compute,utility,video"' -v $PWD:/data IMAGE \
#     detect /data/list.txt --out /data/out
ARG BASE=nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

FROM ${BASE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
# torch's CUDA 13 build, so that its CUDA libraries are the ones ORT and DALI expect.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.11.0
RUN python3 -m venv /opt/gpudet \
 && /opt/gpudet/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY pipeline /src/pipeline
COPY configs /src/configs
COPY models /src/models
# The package with its model and configs inside (pipeline/models, pipeline/configs); pins in pyproject.toml.
RUN /opt/gpudet/bin/pip install --no-cache-dir /src

FROM ${BASE}
# gcc and the Python headers: Triton builds its kernel launcher with them on a kernel's first call
# (pipeline/kernels.py; without them the postprocess runs torch's slower ops, with a warning).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --user-group gpudet \
 && install -d -o gpudet -g gpudet /home/gpudet/.cache /home/gpudet/.cache/gpudet /home/gpudet/.cache/gpudet/triton \
      /home/gpudet/.cache/gpudet/cuda
COPY --from=build /opt/gpudet /opt/gpudet
# What a container compiles on its first command, in one folder to mount as a volume: the
# postprocess's Triton kernels and the kernels the CUDA driver builds from PTX on the model's first run.
ENV PATH=/opt/gpudet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TRITON_CACHE_DIR=/home/gpudet/.cache/gpudet/triton \
    CUDA_CACHE_PATH=/home/gpudet/.cache/gpudet/cuda
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
ENTRYPOINT ["gpudet"]
CMD ["--help"]
