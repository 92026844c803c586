"""The per-job state directory: one entry per live job."""
