# A GPU worker: the official vLLM image plus kvroute, whose `kvroute worker --engine vllm`
# starts vLLM with the prefix-caching and KV-event flags, and whose `kvroute agent` runs
# as the sidecar. Build from the repository root:
#   docker build -f charts/images/worker.Dockerfile -t REGISTRY/kvroute/worker:TAG .
ARG VLLM_VERSION=v0.32.0
FROM vllm/vllm-openai:${VLLM_VERSION}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/kvroute/src
COPY pyproject.toml README.md LICENSE ./
COPY kvindex ./kvindex
COPY router ./router
COPY worker ./worker
COPY loadtest ./loadtest
# kvroute's own dependencies only: vLLM and torch come with the base image.
RUN pip install . \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvroute

WORKDIR /home/kvroute
USER 10001:10001
EXPOSE 8000 8100
ENTRYPOINT ["kvroute"]
CMD ["worker", "--help"]
