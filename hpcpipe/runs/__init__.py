"""A run directory and what it says about the run: the folder itself (`rundir`), a run in
pieces across resumes (`pieces`), what a piece leaves behind — summary, traces, timeline
pictures (`record`) —, step records and progress lines (`metrics`), the end-of-run summary
(`report`), trace.json and the timeline PNGs (`trace`), TensorBoard's event files
(`tensorboard`) and `plot`.

May import: `checkpoint`, `data`, and everything below them. Never `config` or `train`.
"""
