# syntax=docker/dockerfile:1
# MLflow tracking server of the compose stack: the same mlflow version as the clients (constraints.txt),
# the Postgres driver for the run database and boto3 for the S3 (MinIO) artifact store.
# Built from the repository root: docker build -f infra/mlflow.Dockerfile .
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
COPY constraints.txt /tmp/constraints.txt
RUN pip install mlflow boto3 psycopg2-binary -c /tmp/constraints.txt \
 && useradd --create-home mlflow
USER mlflow
EXPOSE 5000
CMD ["mlflow", "server", "--host=0.0.0.0", "--port=5000"]
