"""The ``meshlm`` application: the command line (cli.py, the only Hydra importer), the run
config (config.py), the launcher (launch.py), the training worker (train.py), generate, serve,
plan, show and sweeps.  The library under ``meshlm`` never imports this package."""
