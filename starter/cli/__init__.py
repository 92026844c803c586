"""The command line: `starter run`, the admin's subcommands, `starter spool`."""
