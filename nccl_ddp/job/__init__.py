"""What a job's launcher and its workers share: env (who this worker is, from any launcher's
variables; the default timeout every blocking wait is bounded by) and failure_record (why a worker
failed: written by the worker, read by the launcher). Below everything but errors."""
