"""The faces: command-line entry points (remat-compile, -verify, -run, -show,
-bench) and the tables and reports they print.  They parse arguments, call the
Python API, and print."""
