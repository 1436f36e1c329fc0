"""What operators see: per-request records and the observers that turn them
into metrics, the request log and log lines."""
