# One CPU image for all four turnrl services; docker-compose.yml picks the service per container
# (`turnrl serve <name>`). Build: docker build -t turnrl:cpu .
FROM python:3.11-slim

# bubblewrap: the Python sandbox tool runs untrusted code under bwrap. No recommends, and no apt
# lists left behind, to keep the image small.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

# Unbuffered logs reach `docker logs` at once; no pip cache or version check in the image.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch must be the CPU build: constraints.txt pins torch==2.13.0, which matches 2.13.0+cpu from
# this index (and pip prefers it over the much larger CUDA wheel on PyPI).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /app

# Dependencies first, in their own layer: it is rebuilt only when pyproject.toml or
# constraints.txt change, not on every source edit. Exact versions come from constraints.txt.
COPY pyproject.toml constraints.txt README.md ./
RUN pip install -c constraints.txt --extra-index-url "$TORCH_INDEX_URL" \
    $(python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")

# The packages themselves (pyproject's [tool.setuptools.packages.find]), the proto sources and
# the example configs the services are started with.
COPY turnrl/ turnrl/
COPY turnrl_cli/ turnrl_cli/
COPY turnrl_demo/ turnrl_demo/
COPY tool_svc/ tool_svc/
COPY reward_svc/ reward_svc/
COPY rollout_svc/ rollout_svc/
COPY trainer_svc/ trainer_svc/
COPY protos/ protos/
COPY examples/ examples/

# A regular (non-editable) install without the dev extra; every dependency is already there.
RUN pip install -c constraints.txt --extra-index-url "$TORCH_INDEX_URL" . \
    && rm -rf build ./*.egg-info

# Services do not need root: run as an unprivileged user.
RUN useradd --create-home --uid 10001 turnrl
USER turnrl

# Default ports of tool, reward, rollout and trainer (turnrl.config.DEFAULT_PORTS).
EXPOSE 50051 50052 50053 50054

# Exec form: turnrl is PID 1 and gets SIGTERM itself, so `docker stop` shuts down gracefully.
ENTRYPOINT ["turnrl"]
CMD ["--help"]
