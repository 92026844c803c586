from starter.cli.main import entry

entry()
