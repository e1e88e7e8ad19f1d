# hotloop on NVIDIA GPUs from a slim Python image: no CUDA base image (docs/docker.md says why). Build the
# release wheel into dist/ first, then from the repository's root:
#   docker build -t hotloop . && docker run --rm --gpus all hotloop
FROM python:3.12-slim

# The NVIDIA Container Toolkit mounts the host driver's libcuda (compute) and NVML with nvidia-smi
# (utility) into the container when these ask for them; NVRTC comes with torch's CUDA wheels and nvjpeg
# with torchvision's, so the image needs no CUDA toolkit.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# the README's install commands, as written (tests/packaging/test_dockerfile.py): unpinned there too,
# where the user picks the torch build and takes the newest hotloop
# hadolint ignore=DL3013
RUN python3 -m pip install torch torchvision --index-url https://download.pytorch.org/whl/cu130

# the wheel from dist/ is found first; pip takes numpy from the index
COPY dist/ /wheels/
ENV PIP_FIND_LINKS=/wheels
# hadolint ignore=DL3013
RUN python3 -m pip install hotloop

CMD ["python3", "-m", "hotloop", "doctor"]
