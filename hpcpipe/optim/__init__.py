"""The optimizer step: what it updates — a buffer, its float32 master, a ZeRO shard —, AdamW,
the learning rate and clipping (`adamw`), the global gradient norm (`norm`), the gradient's
one scale and float16 loss scaling (`scaling`), the zero-bubble paper's optimizer
post-validation (`post_validation`) and the record of a finished step (`outcome`).

May import: `device`, `util`, and MPI for the reductions of the norm and the verdict
(communicators are passed in). Never `parallel`, `model` or `config`.
"""
