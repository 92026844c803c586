"""A job's description: its options, the job file, and the validators of every value."""
