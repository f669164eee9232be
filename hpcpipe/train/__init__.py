"""Training: the `Trainer` and its loop (`trainer`), one rank wired together once (`rank`),
one optimizer step — gradients, reduction, norm, AdamW (`step`) —, validation loss
(`evaluate`), which checkpoint a run resumes from (`resume`) and SIGTERM/SIGUSR1
(`preemption`).

May import: `config`, `runs`, `checkpoint`, `data`, `parallel`, `optim`, `model`,
`device`, `schedules`, `util`. Never `cli` or `bench`.
"""
