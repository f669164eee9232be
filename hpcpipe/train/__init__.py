"""Training: the `Trainer` and its loop (`trainer`), one rank wired together once (`rank`),
one optimizer step — gradients, reduction, norm, AdamW (`step`) —, validation loss
(`evaluate`), which checkpoint a run resumes from (`resume`), SIGTERM/SIGUSR1
(`preemption`) and the memory plan checked before launch (`memplan`).

May import: `config`, `runs`, `checkpoint`, `data`, `parallel`, `optim`, `model`,
`device`, `schedules`, `util`. Never `cli` or `bench`.
"""
