"""Ranks working together: the dp × pp × tp grid and every communicator it owns (`grid`),
how arrays meet MPI — directly or staged through pinned host memory (`transport`) —,
tensor parallelism's collectives inside F and B (`tensor`), data parallelism's bucketed
gradient reduction and ZeRO's all-gather (`gradsync`), and the pipeline (`pipeline/`).

May import: `optim`, `model`, `device`, `schedules`, `util`, and MPI. Never `config` (it
owns its section, [parallel]: `section`, and is handed sections, never the whole Config),
`data`, `checkpoint`, `runs`, `train`.
"""
