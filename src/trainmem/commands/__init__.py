"""The ``trainmem`` commands, one module each: cli.COMMANDS names them, and cli.app imports a command's module only
when that command runs (or for ``trainmem --help``). The flags several commands share (cli._workload_options) and the
error handling (cli.main) stay in cli.py."""
