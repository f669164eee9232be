"""Training: the `Trainer` and its loop (`trainer`), one rank wired together once (`rank`),
one optimizer step — gradients, reduction, norm, AdamW (`step`) —, validation loss
(`evaluate`), which checkpoint a run resumes from (`resume`) and SIGTERM/SIGUSR1
(`preemption`); the run's pipeline plan is hpcpipe/plan's.

May import: `plan`, `config`, `runs`, `checkpoint`, `data`, `parallel`, `optim`, `model`,
`device`, `schedules`, `util`. Never `cli` or `bench`.
"""
