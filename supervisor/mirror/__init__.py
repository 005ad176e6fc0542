"""A mirror of checkpoints at an fsspec URL (S3, GCS, a shared filesystem), torch-free."""
