from starter.cli import entry

entry()
