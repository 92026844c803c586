"""The job's files: scratch, --disk, project quotas, verified inputs, link-safe paths."""
