"""The command line: `python -m hpcpipe ...` (`main`), how every command ends — one error
line from one rank, the whole job together (`guard`) —, and the commands that are not a
subsystem's own: `ckpt`, `generate`, `doctor`, `config` (`config_reference`: every key,
generated from the dataclasses) and `plan` (the memory plan, also `train --dry-run`) —
`train` is the trainer's, `schedule` the schedules', `bench` the benchmarks', `plot` the
run directory's.

May import: anything in hpcpipe but `bench`.
"""
