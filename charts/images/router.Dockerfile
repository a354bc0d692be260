# The kvroute router: slim, non-root, no compiler or engine inside.
# Build from the repository root:
#   docker build -f charts/images/router.Dockerfile -t REGISTRY/kvroute/router:TAG .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY kvindex ./kvindex
COPY router ./router
COPY worker ./worker
COPY loadtest ./loadtest
RUN pip install ".[kubernetes]" \
    && rm -rf /src \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvroute

WORKDIR /
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvroute"]
CMD ["router", "--config", "/etc/kvroute/router.yaml"]
