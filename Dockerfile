# The project's one image: the MISA-T router (`misat router`, what the operator renders into each
# pool's router pod) and the operator (`python -m misat_operator`, what charts/misa-t runs).
# Build: `make image` (tag ghcr.io/misa-t/misa-t:<version from pyproject.toml>).
# tests/operator/test_image.py checks the entry points, user and tag against the renderer and chart.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
RUN python -m venv /opt/misat \
    && /opt/misat/bin/pip install --upgrade pip \
    && /opt/misat/bin/pip install '/src[operator]'

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/misat /opt/misat
# `python` and `misat` resolve to the virtual environment; the working directory holds no
# source tree, so no folder shadows an import (the repository's operator/ would shadow the stdlib).
ENV PATH=/opt/misat/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
WORKDIR /tmp
# 65532: the uid/gid the operator renders for router pods (render.ROUTER_UID) and the chart for
# the operator; both run with a read-only root file system and /tmp as an emptyDir.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["misat"]
CMD ["--help"]
