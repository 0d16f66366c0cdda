# One image for every taco-llm process; docker-compose.yml picks the command.
FROM python:3.11-slim
ARG TARGET=cpu
WORKDIR /app
# redis-server: `serve --num-workers K` with the Lookahead Cache starts one for the workers' shared index.
RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ redis-server && rm -rf /var/lib/apt/lists/*
COPY . /app
RUN make install TARGET=${TARGET} VENV=/opt/taco && \
    /opt/taco/bin/python -c "from taco_llm.engine_worker.frontend.default_model import ensure_default_model; ensure_default_model()"
ENV PATH=/opt/taco/bin:$PATH
EXPOSE 8000 50051
CMD ["taco_llm", "serve", "--host", "0.0.0.0"]
