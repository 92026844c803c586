"""What an admin does with live jobs (ps, status, signals) and gc of what a crash left."""
