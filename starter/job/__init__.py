"""One job's lifetime: setup in order, the supervisor beside it, the watchdog, strays."""
