"""What a job reports: the final report, ClassAd, metrics, top, GPU usage."""
