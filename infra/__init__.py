"""Starting the real services FOCUS talks to (S3 server, Prefect server, MLflow server, vLLM server)."""
