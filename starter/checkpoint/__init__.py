"""Checkpoint and restore of a job with CRIU, and the checkpoint directory."""
